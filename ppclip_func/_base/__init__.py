"""What every other module stands on: the torch internals used (and where releases differ), the package's operators, device costs, the caches."""

"""The norm core: layouts and weights, local statistics, the one collective, the ranks' agreement, and a call's setup and failure path."""

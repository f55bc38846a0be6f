"""The demo, and the model and multi-process harness the tests and benchmarks share with it.

Not part of the installed package (the wheel holds ``ppclip_func`` only):

* :mod:`demo.model`: the transformer, its pipeline-stage split and its data;
* :mod:`demo.parallel`: TP, FSDP2/HSDP, EP and DDP plans and the pipeline schedule;
* :mod:`demo.optim`: AdamW as a functional step that compiles with the clip;
* :mod:`demo.harness`: real gloo ranks with a hard timeout (demo, tests, bench);
* :mod:`demo.run`: ``python -m demo``, what ``make demo`` runs.
"""

"""tvmfuse: auto-scheduling memory-bound fusion search on Apache TVM.

The pipeline, one stage per subpackage: ``frontend`` (ONNX -> Relax) -> ``plan`` (fusion) -> ``tune``
(MetaSchedule) -> ``db`` (tuning database) -> ``compile`` (artifact) -> ``runtime`` (load and run).
``tvmfuse.api`` holds the library calls the CLI makes.
"""
__version__ = "0.1.0"

"""Data shipped with tvmfuse: the embedded example model (built by scripts/make_example.py)."""

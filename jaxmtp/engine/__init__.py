"""The host side: the engine loop, scheduling, pages, requests and their outputs. Plain
Python and NumPy, no JAX: the loop (llm_engine) reaches the device through the runner
that jaxmtp.worker.distributed.start_runner builds, and the other modules never load
JAX (tests/test_structure.py)."""

"""The host side: the engine loop, scheduling, pages, requests and their outputs. Plain
Python and NumPy, no JAX: what runs on the device is reached through the worker's named
contracts (ModelRunner, StepResult)."""

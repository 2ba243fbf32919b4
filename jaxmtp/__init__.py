"""jaxmtp: a JAX/XLA inference engine with MTP speculative decoding that stays exact
under chunked prefill."""

__version__ = "0.2.0"


def _import_kernels_from_checkout() -> None:
    """jaxmtp.kernels is the repository's top-level kernels/ folder: a wheel installs it
    inside the package (pyproject's package-dir), an editable install maps it there.
    Run from a checkout (PYTHONPATH=., a worktree beside another checkout's editable
    install), this maps it to the kernels/ beside this package, so that a checkout
    always runs its own kernels."""
    import importlib.abc
    import importlib.util
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parent
    kernels = package.parent / "kernels"
    if (package / "kernels").is_dir() or not (package.parent / "pyproject.toml").is_file() \
            or not (kernels / "__init__.py").is_file():
        return  # installed from a wheel, or no checkout around

    class CheckoutKernels(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "jaxmtp.kernels":
                return None
            return importlib.util.spec_from_file_location(
                fullname, kernels / "__init__.py", submodule_search_locations=[str(kernels)]
            )

    sys.meta_path.insert(0, CheckoutKernels())


_import_kernels_from_checkout()

from jaxmtp.api import LLM  # noqa: E402
from jaxmtp.engine.llm_engine import LLMEngine  # noqa: E402
from jaxmtp.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from jaxmtp.engine.sampling_params import SamplingParams  # noqa: E402
from jaxmtp.engine.structured_outputs import StructuredOutputsParams  # noqa: E402

__all__ = [
    "__version__", "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
    "StructuredOutputsParams",
]

"""What every benchmark mode measures and prints: each request's token arrival times,
the latency percentiles made from them (TTFT, TPOT, ITL, end to end; jaxmtp's and
vLLM's), the environment a figure was measured in (date, device, JAX version), and the
report: vLLM's summary lines, then jaxmtp's sections."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestTimes:
    """One request, in seconds on one clock: when it was sent, when each output that
    carried new tokens arrived (a step or a streamed chunk; with MTP one may carry
    several tokens), and how many tokens it produced."""

    sent: float
    event_times: list[float] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    text: str = ""  # what it generated (serve's; vLLM's generated_texts)

    def record(self, now: float, new_tokens: int) -> None:
        if new_tokens:
            self.event_times.append(now)
            self.num_tokens += new_tokens

    @property
    def ttft(self) -> float:
        return self.event_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.event_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's definition); None for one token."""
        if self.num_tokens < 2:
            return None
        return (self.event_times[-1] - self.event_times[0]) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between successive outputs (not tokens: an output of several tokens is one gap)."""
        return np.diff(self.event_times).tolist()


def percentiles_ms(seconds: list[float]) -> dict[str, float] | None:
    """mean and p50/p90/p99 in milliseconds; None without values."""
    if not seconds:
        return None
    values = np.asarray(seconds, np.float64) * 1e3
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}}


def vllm_stats(seconds: list[float], percentiles: list[float]) -> dict[str, float]:
    """vLLM's figures of a latency in milliseconds: mean, median, std and the percentiles
    (p99, p99.9, ...); all 0 without values, as vLLM's."""
    values = np.asarray(seconds or [0.0], np.float64) * 1e3
    stats = {"mean": values.mean(), "median": np.median(values), "std": values.std()}
    stats.update({f"p{int(p) if p == int(p) else p}": np.percentile(values, p) for p in percentiles})
    return {key: float(value) for key, value in stats.items()}


def line(label: str, value) -> str:
    """A line of vLLM's summary: the label in 40 columns, a float with 2 decimals."""
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"


def heading(text: str, fill: str = "-") -> str:
    return f"{text:{fill}^50}"


def summarize(requests: list[RequestTimes], duration: float) -> dict:
    """Throughput over `duration` seconds and the latency percentiles of the requests
    that produced tokens; failed requests are counted, not timed."""
    done = [r for r in requests if r.error is None and r.event_times]
    output_tokens = sum(r.num_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return {
        "requests": len(requests),
        "failed": len(requests) - len(done),
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": percentiles_ms([r.ttft for r in done]),
        "tpot_ms": percentiles_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": percentiles_ms([gap for r in done for gap in r.itls]),
        "e2e_ms": percentiles_ms([r.e2e for r in done]),
        "errors": sorted({r.error for r in requests if r.error is not None})[:5],
    }


def environment(device: str | None = None) -> dict:
    """The date (UTC), the device (this process's JAX devices unless given), and the
    versions a figure was measured with."""
    import jax

    from jaxmtp import __version__

    if device is None:
        devices = jax.devices()
        device = f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "jax": jax.__version__,
        "jaxmtp": __version__,
        "python": platform.python_version(),
    }


def format_report(title: str, result: dict) -> str:
    """The report as lines: those of the sections environment, settings and results
    that the result has, each figure on a line (a percentile dict on one)."""
    width = 60
    lines = [f" {title} ".center(width, "=")]
    for section in ("environment", "settings", "results"):
        if section not in result:
            continue
        lines.append(f"-- {section}")
        for key, value in result[section].items():
            if isinstance(value, dict):
                value = "  ".join(f"{k} {v:.2f}" for k, v in value.items())
            elif isinstance(value, float):
                value = f"{value:.4g}"
            lines.append(f"{key + ':':<28}{value}")
    lines.append("=" * width)
    return "\n".join(lines)


def emit(title: str, summary: list[str], result: dict, path: str | None) -> None:
    """Print vLLM's summary lines and the report; with a path also write the result there
    as JSON."""
    print("\n".join([*summary, format_report(title, result)]), flush=True)
    if path:
        Path(path).write_text(json.dumps(result, indent=1))

"""Structured outputs, host side (no JAX): constraints compiled by llguidance, one
matcher per sequence, and the token bitmasks of a step's verify rows.

Row j of a constrained request's verify rows samples after its output so far plus the
drafts of rows 0..j-1, so its mask is the grammar's after those drafts too: the matcher
advances over the drafts on a copy's worth of state and rolls back (llguidance computes
all the rows' masks in one call). A draft the grammar forbids is then rejected at its
row as any mismatch is, and the output is token for token what plain decoding under
the grammar gives (the sampler's keyed draw makes speculation change nothing).

A request that continues the step in flight (the usual case, async scheduling)
verifies the device's drafts as they are: the step's first part runs before the host
has read them. Only rows up to the first draft the grammar refuses get masks
(GrammarMatcher.row_drafts). A request whose next step is built from its read output
(after its prefill, without async scheduling) gets drafts chosen inside the grammar:
where the grammar forces the next tokens (JSON punctuation, a property name) those are
the drafts, and otherwise the MTP module's drafts up to the first one it forbids.

A step's masks are computed in one llguidance call over all its rows (two side by side
when some rows have drafts and some have none), spread over llguidance's own threads
with the GIL released, on a worker thread: started as soon as the step before it is
read, so that the fill runs while the host schedules and builds the next step
(LLMEngine._start_masks hands the worker the GIL until the fill has begun). Not one Python thread per request as
each request's drafts arrive: each needs the GIL to start and to finish, which the
host's own Python work holds. The requests' matchers are copies of several compiled
matchers of their grammar (MATCHER_FAMILIES), since copies of one share caches that
only one thread at a time uses: on the H200's host a batch of 32 masks took 2.45 ms on
16 threads from one, 0.40 ms from 8 (benchmarks/grammar_replay.py --families)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llnp
import numpy as np

if TYPE_CHECKING:
    from jaxmtp.engine.scheduler import ScheduledRows
    from jaxmtp.engine.sequence import Sequence

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# llguidance's parser holds at most 2000 items in an Earley row, and a choice's strings
# are one row's alternatives while they share a prefix: more would fail mid-request
MAX_CHOICES = 1999


# The whitespace a JSON constraint allows between two tokens by default: a run of at
# most this many characters. llguidance's default (as vLLM's and SGLang's) is any run, and
# a weak model spends max_tokens on it (issue 34); 4 still allows an indented line.
WHITESPACE_RUN = 4
JSON_WHITESPACE = "[\\x20\\x0A\\x0D\\x09]"


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one of the constraint kinds (KINDS), and for the
    JSON ones (json, json_object) how much whitespace they allow: by default runs of at
    most WHITESPACE_RUN characters between tokens; disable_any_whitespace: none (compact
    JSON); whitespace_pattern: a regex a run of whitespace must match."""

    json: dict | str | None = None  # a JSON schema (a dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF / EBNF as llguidance reads them
    json_object: bool = False  # any JSON object
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}, got {given or 'none'}")
        for name in ("disable_any_whitespace", "whitespace_pattern"):
            if getattr(self, name) not in (None, False) and given[0] not in ("json", "json_object"):
                raise ValueError(f"structured_outputs.{name} applies to json and json_object constraints, not {given[0]}")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured_outputs: disable_any_whitespace and whitespace_pattern contradict each other")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string (a regex)")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices, got {len(self.choice)}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar text."""
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if isinstance(self.json, str) else dict(self.json or {"type": "object"})
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")
            if "x-guidance" in schema and (self.disable_any_whitespace or self.whitespace_pattern is not None):
                raise ValueError("structured_outputs: the schema's x-guidance sets llguidance's whitespace options "
                                 "itself; give them there or in disable_any_whitespace / whitespace_pattern")
            schema.setdefault("x-guidance", self.json_whitespace())  # the schema's own x-guidance as it is
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        return llguidance.grammar_from("grammar", self.grammar)

    def json_whitespace(self) -> dict:
        """llguidance's whitespace options for a JSON constraint."""
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if self.whitespace_pattern is not None:
            return {"whitespace_pattern": self.whitespace_pattern}
        return {"whitespace_pattern": f"{JSON_WHITESPACE}{{1,{WHITESPACE_RUN}}}"}


# Matchers deep-copied from one compiled matcher share its lexer's caches, which are
# warm (a freshly compiled matcher starts them empty) but taken one thread at a time: the masks of a step whose requests all copy one matcher fill no faster on many
# llguidance threads than on one (benchmarks/grammar_replay.py --families). Requests
# copy one of this many compiled matchers of their grammar in turn, the first the one
# that validated it, so that a grammar used once (a request's own schema) compiles once.
MATCHER_FAMILIES = min(8, os.cpu_count() or 1)


class GrammarCompiler:
    """One per engine: llguidance's view of the tokenizer (built once; it takes about a
    second for a large vocabulary) and a cache of validated grammars, each compiled up to
    num_families times (MATCHER_FAMILIES)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids, num_families: int = MATCHER_FAMILIES):
        self.vocab_size = vocab_size
        self.num_families = num_families
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.executor = llguidance.LLExecutor()
        # fill_row_masks' second llguidance call of a step, beside its first
        self.second_fills = ThreadPoolExecutor(1, thread_name_prefix="jaxmtp-masks-second")
        self.mask_words = llnp.get_bitmask_shape(1, vocab_size)[1]

    @functools.lru_cache(maxsize=256)
    def _compiled(self, text: str) -> tuple[object, np.ndarray]:
        """A matcher at the start of grammar `text`, copied for each sequence (compiling
        a large schema is what costs), and the token ids its first mask allows."""
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs does not compile: {matcher.get_error()}")
        probe, mask = matcher.deep_copy(), np.zeros((1, self.mask_words), np.int32)
        llnp.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error():  # a constraint no text satisfies stops at its first mask
            raise ValueError(f"structured_outputs: no text satisfies the constraint ({probe.stop_reason()})")
        first = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size])
        # the text the grammar forces from its start, as decoding will walk it: a grammar
        # that forces more than the parser can hold (`start: "a" start`) fails here
        probe.consume_tokens(probe.compute_ff_tokens())
        if probe.is_error():
            raise ValueError(f"structured_outputs: the constraint forces more text than its parser can hold "
                             f"({probe.get_error().splitlines()[0]})")
        return matcher, first

    @functools.lru_cache(maxsize=256)
    def _uses(self, text: str) -> itertools.count:
        """Counts the matchers made of grammar `text` (its family is the count's turn)."""
        return itertools.count()

    @functools.lru_cache(maxsize=1024)
    def _family(self, text: str, family: int) -> object:
        """Family `family`'s compiled matcher of a grammar _compiled validated (family 0 is
        _compiled's own)."""
        return self._compiled(text)[0] if family == 0 else llguidance.LLMatcher(self.tokenizer, text, log_level=0)

    def matcher(self, params: StructuredOutputsParams, allowed_token_ids: list[int] | None = None) -> GrammarMatcher:
        """A matcher at the start of the constraint; ValueError naming the problem when
        the constraint does not compile, or allows none of allowed_token_ids first."""
        try:
            text = params.grammar_text()
        except (ValueError, TypeError) as err:
            raise ValueError(f"structured_outputs: {err}") from err
        first = self._compiled(text)[1]
        if allowed_token_ids is not None and not np.isin(first, allowed_token_ids).any():
            raise ValueError("allowed_token_ids: the constraint (structured_outputs) allows none of them as the first token")
        return GrammarMatcher(self._family(text, next(self._uses(text)) % self.num_families).deep_copy(), self)


class GrammarMatcher:
    """A sequence's grammar state: advanced by each token it emits."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self._matcher = matcher
        self._compiler = compiler

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; True when the grammar is complete (stopped)."""
        if not self._matcher.consume_token(token):
            raise ValueError(f"structured_outputs: token {token} does not fit the grammar: {self._matcher.get_error()}")
        return self._matcher.is_stopped()

    def propose(self, drafts: list[int], k: int) -> list[int]:
        """The next step's drafts: tokens the grammar forces, else the MTP drafts up to
        the first the grammar forbids."""
        return self._matcher.compute_ff_tokens()[:k] or drafts[: self._matcher.validate_tokens(drafts)]

    def row_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts whose rows get masks: those before the first one the grammar refuses
        from the current state. That draft's row masks it out, so the verify rejects it
        there and nothing after it is emitted: its later rows may allow any token."""
        return list(drafts[: self._matcher.validate_tokens(drafts)]) if drafts else []


def fill_row_masks(rows: list[tuple[GrammarMatcher, int, list[int]]], masks: np.ndarray,
                   began: threading.Event | None = None) -> None:
    """masks [N, W] int32: for each (matcher, first mask row, drafts), the masks of rows
    first..first+len(row_drafts(drafts)), row j's after drafts[:j]. Other rows are left
    as they are. Rows with drafts and rows without take one llguidance call each (it
    refuses an empty draft list); when a step has both, the second runs on a thread of
    its own beside the first, both begun before this returns control: run one after the
    other, the second would wait for the GIL between them, held by the engine's thread
    while it builds the next step. began: set as the calls begin, the second one inside
    llguidance already (llm_engine.LLMEngine._start_masks waits for it)."""
    if not rows:
        return
    compiler = rows[0][0]._compiler
    row_drafts = [(matcher._matcher, first, matcher.row_drafts(drafts)) for matcher, first, drafts in rows]
    with_drafts = [row for row in row_drafts if row[2]]
    without = [(matcher, first) for matcher, first, drafts in row_drafts if not drafts]
    calls = [(fill, group) for fill, group in ((llnp.fill_next_token_bitmask_par_with_draft_tokens, with_drafts),
                                                (llnp.fill_next_token_bitmask_par, without)) if group]
    second = None
    if len(calls) == 2:
        second_began = threading.Event()

        def second_call():
            second_began.set()
            calls[1][0](compiler.executor, calls[1][1], masks)

        second = compiler.second_fills.submit(second_call)
        second_began.wait()  # (the GIL goes to the second thread until it is inside llguidance)
    if began is not None:
        began.set()
    try:
        calls[0][0](compiler.executor, calls[0][1], masks)
    finally:
        if second is not None:
            second.result()


def step_bitmask(rows: list[ScheduledRows], preemptions: list[int], k: int, width: int, num_seqs: int,
                 began: threading.Event | None = None) -> tuple[np.ndarray, list[tuple[Sequence, Exception]]]:
    """The token bitmasks [num_seqs, k+1, W] of a masked step whose shape holds num_seqs
    requests: each constrained request's verify masks (fill_row_masks) where it has output
    and has neither ended nor been preempted since dispatch (preemptions: each one's count
    then; its output is dropped otherwise); every other mask, the padding requests' too,
    allows every token. A sequence whose masks cannot be computed leaves its rows
    allowing every token and is returned with its error. began: set once llguidance
    runs (or when there is nothing to fill)."""
    masks = np.full((num_seqs, k + 1, width), -1, np.int32)
    flat = masks.reshape(-1, width)
    wanted = [(item.seq, i * (k + 1), item.token_ids[1:] if item.num_drafts else []) for i, item in enumerate(rows)
              if item.seq.grammar is not None and item.has_output and not item.seq.finished
              and item.seq.num_preemptions == preemptions[i]]
    try:
        fill_row_masks([(seq.grammar, first, drafts) for seq, first, drafts in wanted], flat, began)
        return masks, []
    except Exception:  # noqa: BLE001 - find the sequences whose grammar fails, one at a time
        failed = []
        for seq, first, drafts in wanted:
            try:
                fill_row_masks([(seq.grammar, first, drafts)], flat)
            except Exception as err:  # noqa: BLE001
                flat[first : first + k + 1] = -1
                failed.append((seq, err))
        return masks, failed
    finally:
        if began is not None:
            began.set()

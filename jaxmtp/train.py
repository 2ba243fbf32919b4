"""Train DeepSeek-style MTP draft modules on a frozen base model with optax.

The module at depth d reads the previous hidden state at position i (the main model's
for d = 1, in the checkpoint layout's convention; its own output for d > 1, as the
engine's chained draft steps do) and the embedding of token i+d, and predicts token
i+d+1 (DeepSeek-V3 section 2.2). Training runs the module through the same paged code
path as inference, on sequences packed one per page range, so what is trained is what
the engine runs.

train_base trains a small base model itself (the reproductions' tiny models of other
families, whose random weights write text no MTP module can learn to draft).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxmtp.engine.allocator import pages_for
from jaxmtp.loading.loader import save_checkpoint
from jaxmtp.models import hybrid, model
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.params import MTPParams, Params, pytree_dataclass
from jaxmtp.worker import mtp
from jaxmtp.worker.batch import Batch, slot_of, unprocessed
from jaxmtp.worker.cache import allocate_cache
from jaxmtp.worker.recurrent import allocate_recurrent


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 192  # tokens per training sequence (longer ones are cut)
    depths: int = 2  # chained depths trained (the engine reuses the module for drafts 2..k)
    soft_targets: bool = False  # distil the main model's distribution instead of data tokens
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    eval_every: int = 250
    checkpoint_every: int = 250
    seed: int = 0


@pytree_dataclass
class TrainState:
    step: jax.Array
    module: MTPParams
    opt_state: optax.OptState


def init_module(params: Params, cfg: ModelConfig, key: jax.Array, block=None) -> MTPParams:
    """Start from the base model's last block (or `block`: a hybrid model's MTP layer is
    a full-attention layer of its own kind) and final norm, the hidden path an identity
    and the token path small, so training begins near 'one more layer of the base'."""
    h = cfg.hidden_size
    dtype = cfg.jnp_dtype
    return MTPParams(
        token_norm=jnp.ones((h,), dtype),
        hidden_norm=jnp.ones((h,), dtype),
        proj_token=(0.02 * jax.random.normal(key, (h, h))).astype(dtype),
        proj_hidden=jnp.eye(h, dtype=dtype),
        block=jax.tree.map(jnp.copy, params.layers[-1] if block is None else block),
        final_norm=jnp.copy(params.final_norm),
    )


def packed_batch(num_seqs: int, seq_len: int, page_size: int) -> Batch:
    """A batch of num_seqs full sequences, each in its own contiguous pages."""
    pages_per_seq = pages_for(seq_len, page_size)
    t = num_seqs * seq_len
    positions = np.tile(np.arange(seq_len, dtype=np.int32), num_seqs)
    seq = np.repeat(np.arange(num_seqs, dtype=np.int32), seq_len)
    page_table = np.arange(num_seqs * pages_per_seq, dtype=np.int32).reshape(num_seqs, pages_per_seq)
    zeros_b = np.zeros(num_seqs, np.int32)
    return Batch(
        input_ids=np.zeros(t, np.int32),
        positions=positions,
        slot_mapping=slot_of(page_table, seq, positions, page_size),
        query_start=np.arange(0, t + 1, seq_len, dtype=np.int32),
        kv_len=np.full(num_seqs, seq_len, np.int32),
        page_table=page_table,
        sample_index=np.zeros((num_seqs, 1), np.int32),
        num_drafts=zeros_b,
        has_output=np.zeros(num_seqs, bool),
        next_chunk_token=zeros_b,
        temperature=np.zeros(num_seqs, np.float32),
        top_k=zeros_b,
        top_p=np.ones(num_seqs, np.float32),
        min_p=np.zeros(num_seqs, np.float32),
        seed=np.zeros(num_seqs, np.uint32),
        output_index=zeros_b,
        carry_index=np.full(num_seqs, -1, np.int32),
        **unprocessed(num_seqs),
    )


def base_forward(params: Params, cfg: ModelConfig, tokens: jax.Array, page_size: int):
    """tokens [S, L], each sequence in pages of its own -> the frozen main model's last
    hidden state [S * L, H], the cache it wrote (with one MTP layer's pages, empty) and
    the batch. A hybrid model's sequences start at position 0, so from zeros: they share
    one recurrent-state slot, whose states after them are dropped."""
    s, length = tokens.shape
    batch = dataclasses.replace(jax.tree.map(jnp.asarray, packed_batch(s, length, page_size)),
                                input_ids=tokens.reshape(-1))
    cache = allocate_cache(cfg, batch.page_table.size, page_size, num_mtp_layers=1)
    ops = model.layer_ops(cfg, "reference")
    if cfg.hybrid is None:
        hidden, cache = model.forward(params, cfg, batch, cache, ops)
    else:
        hidden, cache, _ = hybrid.forward(params, cfg, batch, cache, allocate_recurrent(cfg, 1, 1), ops)
    return hidden, cache, batch


def depth_logits(params: Params, module: MTPParams, cfg: ModelConfig, tokens: jax.Array, depths: int, page_size: int):
    """tokens [S, L] -> (draft logits, teacher logits), each [depths, S, L, V]: depth d at
    position i predicts token i+d+1, and the teacher is the frozen main model's
    prediction of that same token (its logits at position i+d)."""
    s, length = tokens.shape
    hidden, cache, batch = base_forward(params, cfg, tokens, page_size)
    hidden = jax.lax.stop_gradient(hidden)
    ops = model.layer_ops(cfg, "reference")
    main_logits = model.logits(params.head(), params.final_norm, cfg, hidden).reshape(s, length, -1)
    prev = mtp.main_hidden_for_mtp(params, cfg, hidden)
    drafts, teachers = [], []
    k_pages, v_pages = cache.k[-1], cache.v[-1]
    for d in range(1, depths + 1):
        next_ids = jnp.concatenate([tokens[:, d:], jnp.zeros((s, d), tokens.dtype)], axis=1).reshape(-1)
        prev, k_pages, v_pages = mtp.module_forward(
            module, params.embed, cfg, prev, next_ids, batch, k_pages, v_pages, ops
        )
        drafts.append(mtp.module_logits(params, module, cfg, prev).reshape(s, length, -1))
        teachers.append(jnp.concatenate([main_logits[:, d:], jnp.zeros_like(main_logits[:, :d])], axis=1))
    return jnp.stack(drafts), jnp.stack(teachers)


def targets_and_mask(tokens: jax.Array, lengths: jax.Array, depths: int):
    """Depth d at position i predicts token i+d+1, which must lie within the sequence."""
    s, length = tokens.shape
    targets, masks = [], []
    pos = jnp.arange(length)[None, :]
    for d in range(1, depths + 1):
        targets.append(jnp.concatenate([tokens[:, d + 1 :], jnp.zeros((s, d + 1), tokens.dtype)], axis=1))
        masks.append(pos + d + 1 < lengths[:, None])
    return jnp.stack(targets), jnp.stack(masks)


def base_loss(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, page_size: int):
    """The main model's mean next-token cross-entropy over each sequence's tokens."""
    s, length = tokens.shape
    hidden, _, _ = base_forward(params, cfg, tokens, page_size)
    logits = model.logits(params.head(), params.final_norm, cfg, hidden).reshape(s, length, -1)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    mask = jnp.arange(1, length)[None, :] < lengths[:, None]
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)


def committed_like(params: Params, tree):
    """tree committed to the device of params, as a jitted step's outputs are: left
    uncommitted, the second step would compile again."""
    return jax.device_put(tree, next(iter(jax.tree.leaves(params)[0].sharding.device_set)))


def train_base(params: Params, cfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray, config: TrainConfig,
               page_size: int = 16, progress: bool = True) -> tuple[Params, list[float]]:
    """Train every weight of a small base model but its MTP modules on token sequences
    [N, L] (for the reproductions' tiny models, whose random weights write text no MTP
    module can learn to draft); returns the params and the loss per step."""
    optimizer = make_optimizer(config)
    trainable = jax.tree.map(jnp.copy, dataclasses.replace(params, mtp=[]))  # each step donates its weights

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(weights, opt_state, batch_tokens, batch_lengths):
        loss, grads = jax.value_and_grad(base_loss)(weights, cfg, batch_tokens, batch_lengths, page_size)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, loss

    trainable, opt_state = committed_like(params, (trainable, optimizer.init(trainable)))
    losses = []
    for i in tqdm(range(config.steps), desc="train-base", disable=not progress):
        idx = np.random.default_rng([config.seed, i]).integers(0, len(tokens), size=config.batch_size)
        trainable, opt_state, loss = step(trainable, opt_state, jnp.asarray(tokens[idx]), jnp.asarray(lengths[idx]))
        losses.append(float(loss))
    return dataclasses.replace(trainable, mtp=params.mtp), losses


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.steps, config.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def loss_fn(module, params, cfg, tokens, lengths, depths, page_size, soft_targets):
    """Cross-entropy of each depth's draft against the data token, or (soft_targets)
    against the frozen main model's own distribution for that token, which is what
    greedy and lossless speculative acceptance reward."""
    logits, teacher = depth_logits(params, module, cfg, tokens, depths, page_size)
    targets, mask = targets_and_mask(tokens, lengths, depths)
    if soft_targets:
        losses = optax.softmax_cross_entropy(logits, jax.nn.softmax(teacher))
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    per_depth = jnp.sum(losses * mask, axis=(1, 2)) / jnp.maximum(jnp.sum(mask, axis=(1, 2)), 1)
    return jnp.mean(per_depth), per_depth


def accuracy(params, module, cfg, tokens, lengths, depths, page_size):
    """Top-1 accuracy of the draft per depth over the valid positions."""
    logits, _ = depth_logits(params, module, cfg, tokens, depths, page_size)
    targets, mask = targets_and_mask(tokens, lengths, depths)
    hits = (jnp.argmax(logits, -1) == targets) & mask
    return jnp.sum(hits, axis=(1, 2)) / jnp.maximum(jnp.sum(mask, axis=(1, 2)), 1)


def pad_sequences(sequences: list[list[int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(sequences), seq_len), np.int32)
    lengths = np.zeros(len(sequences), np.int32)
    for i, seq in enumerate(sequences):
        seq = seq[:seq_len]
        tokens[i, : len(seq)] = seq
        lengths[i] = len(seq)
    return tokens, lengths


# Story openings for self-distillation. Held-out prompts for evaluation and acceptance
# measurements use other names and openings, so they never appear in training.
TRAIN_NAMES = ["Lily", "Tom", "Ben", "Mia", "Sue", "Max", "Anna", "Tim", "Sara", "Jack", "Lucy", "Sam"]
TRAIN_OPENINGS = [
    "Once upon a time, {name}", "One day, {name} went to the", "{name} had a big", "{name} and her mom",
    "{name} liked to play with", "There was a little", "{name} saw a", "In the park, {name}",
    "{name} was sad because", "The sun was shining and {name}",
]
HELD_OUT_NAMES = ["Zoe", "Leo", "Emma", "Bob"]
HELD_OUT_OPENINGS = [
    "Long ago, {name} found a", "{name} wanted to build a", "At night, {name} looked at the",
    "{name} and his friend went to the", "It was a rainy day and {name}",
]


def story_prompts(names: list[str], openings: list[str]) -> list[str]:
    return [opening.format(name=name) for opening in openings for name in names]


def self_distillation_corpus(llm, prompts: list[str], samples_per_prompt: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Text the base model writes itself: sampled at several temperatures plus greedy."""
    from jaxmtp.engine.sampling_params import SamplingParams

    requests, params = [], []
    temperatures = (0.0, 0.5, 0.8, 1.0)
    for p, prompt in enumerate(prompts):
        for j in range(samples_per_prompt):
            temperature = temperatures[j % len(temperatures)]
            if temperature == 0.0 and j >= len(temperatures):
                continue  # one greedy continuation per prompt is enough
            requests.append(prompt)
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + 7919 * p + j))
    outputs = llm.generate(requests, params)
    return [out.prompt_token_ids + out.outputs[0].token_ids for out in outputs]


class Trainer:
    def __init__(self, params: Params, cfg: ModelConfig, config: TrainConfig, page_size: int = 16):
        if cfg.quantization is not None:
            raise ValueError("training an MTP module on an fp8 (quantization_config) base model is not implemented")
        if cfg.mtp_layout is None:
            cfg = dataclasses.replace(cfg, mtp_layout="deepseek", num_mtp_modules=1)
        # a hybrid model's MTP block differs from its layers: the checkpoint's is the start
        self._block = params.mtp[0].block if cfg.hybrid is not None and params.mtp else None
        if cfg.hybrid is not None and self._block is None:
            raise ValueError(f"training an MTP module for the hybrid model {cfg.model_type} needs a checkpoint with "
                             "one (mtp.*), whose full-attention layer it starts from")
        self.params = dataclasses.replace(params, mtp=[])
        self.cfg = cfg
        self.config = config
        self.page_size = page_size
        self.optimizer = make_optimizer(config)
        depths, page = config.depths, page_size

        def train_step(state: TrainState, tokens, lengths):
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, per_depth), grads = grad_fn(
                state.module, self.params, cfg, tokens, lengths, depths, page, config.soft_targets
            )
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.module)
            module = optax.apply_updates(state.module, updates)
            return TrainState(state.step + 1, module, opt_state), loss, per_depth

        self.train_step = jax.jit(train_step, donate_argnums=0)
        self.eval_accuracy = jax.jit(lambda m, t, n: accuracy(self.params, m, cfg, t, n, depths, page))

    def init_state(self) -> TrainState:
        module = init_module(self.params, self.cfg, jax.random.key(self.config.seed), self._block)
        state = TrainState(jnp.zeros((), jnp.int32), module, self.optimizer.init(module))
        return committed_like(self.params, state)

    def fit(self, train_tokens, train_lengths, eval_tokens, eval_lengths, checkpoint_dir: Path | None = None,
            progress: bool = True, stop_at: int | None = None) -> tuple[TrainState, dict]:
        """Train, resuming from checkpoint_dir's latest orbax step if there is one;
        stop_at ends this run early (a checkpoint is written there)."""
        import orbax.checkpoint as ocp

        config = self.config
        state = self.init_state()
        manager = None
        history = {"step": [], "loss": [], "eval_step": [], "eval_accuracy": []}
        if checkpoint_dir is not None:
            manager = ocp.CheckpointManager(Path(checkpoint_dir).absolute() / "train_state",
                                            options=ocp.CheckpointManagerOptions(max_to_keep=2))
            if manager.latest_step() is not None:
                step = manager.latest_step()
                restored = manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(state), history=ocp.args.JsonRestore()))
                state, history = restored.state, restored.history
        start = int(state.step)
        end = config.steps if stop_at is None else min(stop_at, config.steps)
        bar = tqdm(range(start, end), initial=start, total=config.steps, desc="train-mtp", disable=not progress)
        for step in bar:
            # batches depend only on (seed, step), so a resumed run continues exactly
            idx = np.random.default_rng([config.seed, step]).integers(0, len(train_tokens), size=config.batch_size)
            state, loss, per_depth = self.train_step(state, jnp.asarray(train_tokens[idx]), jnp.asarray(train_lengths[idx]))
            if step % 10 == 0 or step == config.steps - 1:
                history["step"].append(step + 1)
                history["loss"].append(float(loss))
                bar.set_postfix(loss=f"{float(loss):.3f}")
            done = step + 1 == config.steps
            if (step + 1) % config.eval_every == 0 or done:
                acc = self.evaluate(state.module, eval_tokens, eval_lengths)
                history["eval_step"].append(step + 1)
                history["eval_accuracy"].append(acc)
                bar.write(f"step {step + 1}: held-out draft top-1 accuracy per depth {[round(a, 4) for a in acc]}")
            if manager is not None and ((step + 1) % config.checkpoint_every == 0 or step + 1 == end):
                manager.save(step + 1, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), history=ocp.args.JsonSave(history)))
        if manager is not None:
            manager.wait_until_finished()
        return state, history

    def evaluate(self, module: MTPParams, tokens, lengths, batch_size: int = 32) -> list[float]:
        hits = np.zeros(self.config.depths)
        weight = 0
        for i in range(0, len(tokens), batch_size):
            n = len(tokens[i : i + batch_size])
            acc = np.asarray(self.eval_accuracy(module, jnp.asarray(tokens[i : i + batch_size]),
                                                jnp.asarray(lengths[i : i + batch_size])))
            hits += acc * n
            weight += n
        return (hits / weight).tolist()

    def export(self, module: MTPParams, out_dir: Path, source_dir: Path) -> Path:
        """The base model plus the trained module as an engine checkpoint."""
        return save_checkpoint(out_dir, dataclasses.replace(self.params, mtp=[module]), self.cfg, source_dir)


def plot_loss(history: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"train-mtp: {path.name} not drawn: matplotlib is not installed (pip install 'jaxmtp[plots]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(history["step"], history["loss"], label="train loss (mean over depths)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("MTP head training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_history(history: dict, path: Path) -> None:
    path.write_text(json.dumps(history, indent=1) + "\n")


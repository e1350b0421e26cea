"""Peak memory of an RL update at a small and a Gemma-3-sized vocabulary (262,144), on the CPU.

    .venv/bin/python benchmarks/large_vocab_memory.py [--model tiny-random-qwen3] [--vocab 1024 262144] [--top-k 0]

Each vocabulary gets a tiny config with that vocabulary (posttrain.models.
builtin.tiny_config), a policy and a frozen reference copy, AdamW, 8 samples of 64 tokens (2 prompts
of 16 tokens x 4 completions of 48: the shared-prefix layout of an RL micro-batch), GRPO's clipped
loss with a k3 KL term (β = 0.04). One warm-up update allocates the optimizer state; the measured
update then runs, phase by phase, what rl/step.py runs, over two micro-batches:

    reference  log π_ref of the loss tokens (no graph)
    step{i}    log π + entropy (kept-set log-probs with --top-k), the loss, backward (micro-batch i)
    optimizer  clip, AdamW step (foreach=False), zero_grad

What is measured: the process's resident set (Linux VmRSS / VmHWM, the peak reset through
/proc/self/clear_refs before each phase), with glibc returning every allocation of 64 KiB or more to
the system when it is freed (MALLOC_MMAP_THRESHOLD_=65536, set for the child), so the peak is the
real high-water mark of live buffers, allocator and kernel workspaces included. Per phase, `peak` =
VmHWM - VmRSS at the phase's start, which already holds the weights (policy and reference), AdamW's
two moments and, from the second micro-batch on, .grad. For micro-batch i: forward{i} (the policy's
log-probs, entropy and loss), step{i} (forward and backward), and transient{i} = step{i} minus
`gradient_bytes` (one dense gradient per parameter, twice a tied embedding / lm_head matrix): the
first micro-batch leaves exactly those as .grad; a later one produces them again and adds each into
.grad, so they are an upper bound of what it holds at once (transient1 < 0 when not all coexist,
e.g. untied embedding and head gradients, computed at different times). The weights, moments and
gradients grow with V; the transients should not. Prints one JSON object per case (MiB) and the ratios of the largest
vocabulary's forward / transient to the smallest's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from types import SimpleNamespace


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peak:
    """Resident-set growth over a block: .peak = VmHWM - VmRSS at entry (bytes)."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = _status("VmHWM") - self.start
        self.end = _status("VmRSS") - self.start


def build(name: str, vocab: int, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.builtin import tiny_config
    from posttrain.ops.attention import install

    cfg = tiny_config(name, vocab_size=vocab)
    cfg.initializer_range = 0.1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.set_attn_implementation(install())
    return model


def rl_batch(vocab: int, top_k: int):
    import torch

    from posttrain.rollout.trajectory import Trajectory, make_batches

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (16,), generator=g).tolist() for _ in range(2)]
    trajs = []
    for i in range(8):
        kept = torch.full((48,), top_k, dtype=torch.long) if top_k else None
        t = Trajectory(prompts[i // 4], torch.randint(5, vocab, (48,), generator=g).tolist(), torch.zeros(48), i // 4,
                       kept=kept, reward=float(i % 2))
        t.advantage = 1.0 if i % 2 else -1.0
        trajs.append(t)
    (batch,) = make_batches(trajs, pad_id=0, token_budget=10_000)
    return batch


def gradient_bytes(policy) -> int:
    """The gradient memory a backward necessarily holds at once: one dense gradient per parameter, plus, when
    the input embedding and lm_head share one matrix, that matrix's second dense gradient (autograd receives
    the head's and the embedding's -- PyTorch's embedding backward is a dense V x H tensor -- and adds one
    into the other). A first micro-batch leaves them as .grad; a later one adds them into .grad."""
    grads = sum(q.numel() * q.element_size() for q in policy.parameters() if q.requires_grad)
    emb, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    return grads + (emb.numel() * emb.element_size() if emb is head and emb.requires_grad else 0)


def update(policy, ref, optimizer, b, measure: bool, micro_batches: int = 1) -> dict:
    """One update as rl/step.py runs it, over `micro_batches` copies of b (gradients accumulate); with
    `measure`, the peak of each phase of each micro-batch (bytes)."""
    import torch

    from posttrain.algos import policy_losses
    from posttrain.recipes.rl import phases as ph
    from posttrain.training.optim import optimizer_step

    cfg = SimpleNamespace(loss_args={}, sampling=SimpleNamespace(max_new_tokens=48))
    norms = {"agg": "token_mean", "tokens": int(b.loss_mask.sum()), "seqs": int(b.valid.sum())}
    out = {"gradients": gradient_bytes(policy)}
    with Peak() as p:
        with torch.no_grad():
            b.ref_logp, _ = ph.policy_logps(ref, b, 1.0, "none", truncated=False)
    out["reference"] = p.peak
    for i in range(micro_batches):
        with Peak() as p:
            logp, _ = ph.policy_logps(policy, b, 1.0, "none", truncated=True, with_entropy=True)
            b.old_logp = logp.detach()
            loss, _ = ph.batch_loss(logp, b, policy_losses.get("clip_higher"), cfg, 0.04, "k3", None, norms)
            out[f"forward{i}"] = _status("VmHWM") - p.start
            loss.backward()
            del logp, loss
        out[f"step{i}"] = p.peak
        out[f"transient{i}"] = p.peak - out["gradients"]  # beyond weights, AdamW moments, .grad and the gradients
    with Peak() as p:
        optimizer_step(policy, optimizer, 1.0)
    out["optimizer"] = p.peak
    return out if measure else {}


def measure_case(name: str, vocab: int, top_k: int = 0, micro_batches: int = 2) -> dict:
    import torch

    torch.set_num_threads(1)
    policy = build(name, vocab)
    ref = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, foreach=False)
    b = rl_batch(vocab, top_k)
    update(policy, ref, optimizer, b, measure=False)  # allocates AdamW's moments, checks the head once
    weights = sum(q.numel() * q.element_size() for m in (policy, ref) for q in m.parameters())
    row = {"model": name, "vocab": vocab, "top_k": top_k, "loss_tokens": int(b.loss_mask.sum()),
           "tokens": int(b.input_ids.numel()), "weights": weights,
           **update(policy, ref, optimizer, b, measure=True, micro_batches=micro_batches)}
    return row


def run_cases(name: str, vocabs: list[int], top_k: int = 0) -> list[dict]:
    """measure_case for each vocabulary, in one fresh process in which glibc returns every freed block of
    64 KiB or more to the system at once (each phase's peak is measured from its own start)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    code = ("import json, sys; sys.path.insert(0, %r); import large_vocab_memory as m; "
            "print(json.dumps([m.measure_case(%r, v, %d) for v in %r]))"
            % (os.path.dirname(os.path.abspath(__file__)), name, top_k, list(vocabs)))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"measuring {name} at V={vocabs} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random-qwen3")
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 262144])
    ap.add_argument("--top-k", type=int, default=0, help="kept-set size of every sampled token (0: temperature only)")
    args = ap.parse_args()
    rows = run_cases(args.model, args.vocab, args.top_k)
    for r in rows:
        print(json.dumps({k: (round(v / 2**20, 2) if isinstance(v, int) and k not in ("vocab", "top_k", "loss_tokens", "tokens")
                              else v) for k, v in r.items()}))  # bytes -> MiB
    if len(rows) > 1:
        for key in ("forward0", "transient0", "transient1"):
            print(f"{key} V={rows[-1]['vocab']} / V={rows[0]['vocab']}: {rows[-1][key] / rows[0][key]:.2f}")

if __name__ == "__main__":
    main()

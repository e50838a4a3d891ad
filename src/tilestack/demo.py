"""`tilestack demo`: the stack's end-to-end job — long-context generation of a Llama model on kvpool.

A small Llama-architecture transformers model (random weights, fixed seed) reads a long context
with a planted needle, through tilestack.hf: kvpool's paged cache with prefix caching, and
dataengine's Quest block selection for sparse decode. Four requests share the context:

  A  dense, cold          context + question A      (prefills everything)
  B  dense, prefix hit    context + needle question (the context's blocks come from the pool)
  C  sparse, prefix hit   the same prompt as B, decode attends to top_k blocks per kv head
  D  sparse, every block  the control: the same sparse path with a budget covering every block

Each request prefills, then decodes the needle's tokens (teacher-forced: the query that must find
the needle) and then generates greedily. The report: prefix hit rate, time to first token cold vs
cached, per-step decode time dense vs sparse, attention-mass recall of the sparse selection, and
agreement of the sparse tokens with the dense ones. README "The demo" says what the figures mean.

The needle is findable because layer 0's first kv head is planted as a token-identity matcher for
the needle's token ids (plant_needle_finder): a needle token's query finds the earlier copy of
itself wherever it is. The other heads keep their random weights (diffuse attention).

`tilestack demo --examples` runs every installed package's README example instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys
import tempfile
import time
import traceback

from .packages import PACKAGES, installed_version, readme_examples


# ----------------------------------------------------------------------------- README examples
def run_example(code: str, label: str) -> None:
    """Run one example as a script file (tilelang reads kernel source with inspect, which needs one)."""
    fd, path = tempfile.mkstemp(prefix=f"{label}_example_", suffix=".py")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(code)
        runpy.run_path(path, run_name="__main__")
    finally:
        os.unlink(path)


def run_examples() -> int:
    failures = 0
    for pkg in PACKAGES:
        if installed_version(pkg) is None:
            print(f"== {pkg.module}: not installed, skipped")
            continue
        blocks = readme_examples(pkg)
        if not blocks:
            print(f"== {pkg.module}: no example in its README")
            continue
        print(f"== {pkg.module}: README example ({pkg.role})", flush=True)
        t0 = time.perf_counter()
        try:
            run_example(blocks[0], pkg.module)
        except Exception:
            failures += 1
            traceback.print_exc()
            print(f"== {pkg.module}: FAILED")
            continue
        print(f"== {pkg.module}: ok in {time.perf_counter() - t0:.2f} s", flush=True)
    return 1 if failures else 0


# ----------------------------------------------------------------------------- the long-context job
class Progress:
    """A one-line text progress bar (carriage return on a terminal, dots otherwise)."""

    def __init__(self, total: int, label: str, stream=None) -> None:
        self.total, self.label, self.n = max(total, 1), label, 0
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._draw()

    def update(self, k: int = 1) -> None:
        self.n = min(self.total, self.n + k)
        self._draw()

    def _draw(self) -> None:
        width = 30
        fill = int(width * self.n / self.total)
        line = f"  {self.label:<34} [{'#' * fill}{'.' * (width - fill)}] {self.n}/{self.total}"
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        return line

    def close(self) -> None:
        self.n = self.total
        line = self._draw()
        if not self.tty:
            self.stream.write(line)
        self.stream.write(f"  {time.perf_counter() - self.t0:.2f} s\n")
        self.stream.flush()


NEEDLE_IDS = 64  # the last 64 token ids: never in the filler, so a needle made of them is unique


def build_model(device: str, dtype, seed: int = 0, vocab: int = 1024, layers: int = 4, max_len: int = 1 << 17,
                head_dim: int = 32):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=max_len,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e12}, pad_token_id=None,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    plant_needle_finder(model, seed)
    return model.to(device=device, dtype=dtype)


def plant_needle_finder(model, seed: int, score: float = 14.0, rank: int = 16) -> None:
    """Layer 0, kv head 0 and its q heads become a token-identity matcher for the needle ids.

    The needle ids' embeddings get a large component in a `rank`-dim subspace S of the hidden
    size that every other id nearly lacks; the head's q and k projections are one matrix W
    reading S into RoPE's slow channels. A needle token's query then scores about `score` (after
    the 1/sqrt(d) scaling) against an earlier copy of itself and little against filler keys, so
    its attention — and the Quest bound of the block holding the copy — stands out.
    """
    import torch

    cfg = model.config
    attn = model.model.layers[0].self_attn
    d, hidden, vocab = attn.head_dim, cfg.hidden_size, cfg.vocab_size
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    slow = [i for i in range(d) if i % (d // 2) >= d // 4]  # the slower half of the rotary frequencies
    g = torch.Generator().manual_seed(seed + 1)
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        std = emb.std()
        emb[:, :rank] *= 0.05
        emb[vocab - NEEDLE_IDS:, :rank] = torch.randn(NEEDLE_IDS, rank, generator=g) * 3 * std
        w = torch.zeros(d, hidden)
        w[slow, :rank] = torch.randn(len(slow), rank, generator=g)
        x = model.model.layers[0].input_layernorm(emb[vocab - NEEDLE_IDS:])
        w *= math.sqrt(score * math.sqrt(d) / float(((x @ w.T) ** 2).sum(-1).mean()))
        attn.k_proj.weight[:d] = w
        for h in range(group):
            attn.q_proj.weight[h * d:(h + 1) * d] = w


class RecallProbe:
    """Observer of the sparse decode steps: share of the dense softmax mass inside the chosen blocks."""

    def __init__(self, cache, needle_heads: int) -> None:
        self.cache, self.needle_heads = cache, needle_heads
        self.active = False
        self.all, self.needle, self.hit = [], [], []
        self.needle_block: int | None = None

    def __call__(self, layer, q, block_table, seq_lens, block_indices) -> None:
        import torch

        if not self.active or block_indices is None:
            return
        pool = self.cache.pool
        sid = self.cache.seq_ids[0]
        k, _ = pool.gather(layer, sid, dtype=torch.float32)  # [L, H, D]
        L, H, D = k.shape
        hq = q.shape[1]
        qf = q[0].float().view(H, hq // H, D)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qf, k) / math.sqrt(D), -1)  # [H, G, L]
        blocks = torch.arange(L, device=k.device) // pool.block_size
        chosen = block_indices[0].long()  # [H, n]
        for h in range(H):
            sel = torch.isin(blocks, chosen[h][chosen[h] >= 0])
            mass = p[h][:, sel].sum(-1)  # [G]
            self.all.extend(mass.tolist())
            if layer == 0 and h < self.needle_heads:
                self.needle.extend(mass.tolist())
                if self.needle_block is not None:
                    self.hit.append(bool((chosen[h] == self.needle_block).any()))


def _request(model, cache, prompt, forced, n_free: int, label: str, probe=None, follow=None):
    """Prefill `prompt`, decode the `forced` tokens, then `n_free` greedy ones; times each part.

    With `follow` (another request's greedy tokens), the free steps are fed those tokens instead of
    their own, so each step's choice is compared on the same inputs.
    """
    import torch

    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    bar = Progress(1 + len(forced) + n_free, label)
    ids = torch.tensor([prompt], device=dev)
    t0 = time.perf_counter()
    start = cache.new_request(ids)
    with torch.no_grad():
        logits = model(ids[:, start:], cache=cache).logits[:, -1]
    sync()
    ttft = time.perf_counter() - t0
    bar.update()
    steps, free = [], []
    nxt = logits.argmax(-1, keepdim=True)
    for i in range(len(forced) + n_free):
        if i < len(forced):
            x = torch.tensor([[forced[i]]], device=dev)
        elif follow is not None:
            x = torch.tensor([[follow[i - len(forced)]]], device=dev)
        else:
            x = nxt
        if probe is not None:
            probe.active = i < len(forced)
        t = time.perf_counter()
        with torch.no_grad():
            logits = model(x, cache=cache).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        sync()
        steps.append(time.perf_counter() - t)
        if i >= len(forced) - 1:
            free.append(int(nxt))
        bar.update()
    bar.close()
    if probe is not None:
        probe.active = False
    return {"ttft_s": ttft, "cached_tokens": start, "step_s": steps, "tokens": free[:n_free]}


def run(device: str | None = None, context: int | None = None, new_tokens: int = 12, top_k: int | None = None,
        seed: int = 0, json_path: str | None = None, out=None, threads: int | None = None) -> dict:
    """The long-context job; returns (and prints) its report."""
    import torch

    out = out or sys.stdout
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    threads_note = ""
    if threads is None and not on_gpu and hasattr(os, "getloadavg") and os.getloadavg()[0] >= (os.cpu_count() or 1):
        threads = 1  # an oversubscribed machine: intra-op threads only wait for each other (5x slower steps here)
        threads_note = f" (load average {os.getloadavg()[0]:.0f} >= {os.cpu_count()} cores)"
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        threads_note = f", {threads} torch thread{'s' if threads > 1 else ''}" + threads_note
    try:
        return _run(device, on_gpu, context, new_tokens, top_k, seed, json_path, out, threads_note)
    finally:
        torch.set_num_threads(previous_threads)


def _run(device, on_gpu, context, new_tokens, top_k, seed, json_path, out, threads_note) -> dict:
    import torch

    import tilestack.hf as th

    context = context or (32768 if on_gpu else 4096)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    block = 16
    top_k = top_k or max(8, context // block // 16)  # 1/16 of the context's blocks
    vocab, needle_len = 1024, 8
    g = torch.Generator().manual_seed(seed)
    filler = torch.randint(0, vocab - NEEDLE_IDS, (context,), generator=g).tolist()
    needle = (torch.randperm(NEEDLE_IDS, generator=g)[:needle_len] + vocab - NEEDLE_IDS).tolist()
    depth = int(context * 0.4) // block * block + 3  # not block-aligned
    ctx = filler[:depth] + needle + filler[depth:context - needle_len]
    question_a = torch.randint(0, vocab - NEEDLE_IDS, (12,), generator=g).tolist()
    question_b = torch.randint(0, vocab - NEEDLE_IDS, (12,), generator=g).tolist()

    head_dim = 64 if on_gpu else 32  # kvpool's CUDA decode kernel takes head_dim 64/128/256
    print(f"TileStack demo: {context}-token context, Llama-architecture model (4 layers, GQA 8/2, d{head_dim}, random "
          f"weights), {device}, {str(dtype).replace('torch.', '')}{threads_note}", file=out)
    print(f"  kvpool blocks of {block} tokens, prefix caching on; sparse decode: top {top_k} blocks of "
          f"{-(-context // block)} per kv head (sink 1, local 1); needle of {needle_len} tokens at depth {depth}",
          file=out, flush=True)
    model = build_model(device, dtype, seed, head_dim=head_dim)
    blocks_needed = 2 * -(-(context + 64 + needle_len + new_tokens) // block) + 8
    cache = th.enable_kvpool(model, num_blocks=blocks_needed, block_size=block)

    a = _request(model, cache, ctx + question_a, needle, new_tokens, "A dense, cold")
    b = _request(model, cache, ctx + question_b, needle, new_tokens, "B dense, prefix cached")
    cache.sparse = th.SparseConfig(top_k=top_k, sink_blocks=1, local_blocks=1)
    probe = RecallProbe(cache, needle_heads=1)
    probe.needle_block = (depth + needle_len // 2) // block
    cache.observer = probe
    c = _request(model, cache, ctx + question_b, needle, new_tokens, "C sparse, prefix cached", probe=probe,
                 follow=b["tokens"])
    wide = -(-(context + 64) // block)  # every block: the control (sparse machinery, nothing dropped)
    cache.sparse = th.SparseConfig(top_k=wide, sink_blocks=1, local_blocks=1)
    probe_d = RecallProbe(cache, needle_heads=1)
    cache.observer = probe_d
    d = _request(model, cache, ctx + question_b, needle, new_tokens, "D sparse, every block", probe=probe_d,
                 follow=b["tokens"])
    cache.observer = None
    stats = cache.stats()
    th.disable_kvpool(model)

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    agree = sum(x == y for x, y in zip(b["tokens"], c["tokens"])) / max(len(b["tokens"]), 1)
    agree_wide = sum(x == y for x, y in zip(b["tokens"], d["tokens"])) / max(len(b["tokens"]), 1)
    report = {
        "device": device, "dtype": str(dtype).replace("torch.", ""), "context_tokens": context, "top_k_blocks": top_k,
        "context_blocks": -(-context // block), "prefix_hit_rate": stats["prefix_hit_rate"],
        "pool_hit_rate": stats["hit_rate"], "ttft_cold_s": a["ttft_s"], "ttft_cached_s": b["ttft_s"],
        "cached_tokens_b": b["cached_tokens"], "step_dense_s": med(b["step_s"]), "step_sparse_s": med(c["step_s"]),
        "recall_needle_head": sum(probe.needle) / max(len(probe.needle), 1),
        "needle_block_selected": sum(probe.hit) / max(len(probe.hit), 1),
        "recall_all_heads": sum(probe.all) / max(len(probe.all), 1),
        "attended_fraction_sparse": top_k / -(-context // block),
        "sparse_dense_token_agreement": agree, "wide_top_k_blocks": wide,
        "wide_sparse_dense_token_agreement": agree_wide,
        "wide_recall_all_heads": sum(probe_d.all) / max(len(probe_d.all), 1),
        "dense_tokens": b["tokens"], "sparse_tokens": c["tokens"],
    }
    print("Report", file=out)
    print(f"  prefix hit rate        {report['prefix_hit_rate']:.1%} of all prompt tokens came from the pool "
          f"(request B reused {b['cached_tokens']} of {len(ctx) + 12})", file=out)
    print(f"  time to first token    cold {a['ttft_s'] * 1e3:.1f} ms, prefix cached {b['ttft_s'] * 1e3:.1f} ms "
          f"({a['ttft_s'] / b['ttft_s']:.1f}x)", file=out)
    print(f"  decode step            dense {report['step_dense_s'] * 1e3:.2f} ms, sparse "
          f"{report['step_sparse_s'] * 1e3:.2f} ms (median, whole model; "
          f"{'CUDA kernels' if on_gpu else 'CPU torch reference: reads every block, masks the rest'})", file=out)
    print(f"  selection recall       needle head {report['recall_needle_head']:.1%} of its attention mass inside "
          f"the {top_k} chosen blocks (needle block chosen {report['needle_block_selected']:.0%} of steps); "
          f"all heads {report['recall_all_heads']:.1%}", file=out)
    print(f"  sparse vs dense tokens {agree:.0%} of {len(b['tokens'])} greedy steps pick the dense token "
          f"(fed the same tokens); control D with every block: {agree_wide:.0%}, recall "
          f"{report['wide_recall_all_heads']:.1%}", file=out)
    pool = stats
    print(f"  pool                   {pool['blocks_used']} of {pool['blocks_total']} blocks in use, "
          f"{pool['blocks_cached']} prefix-cached", file=out, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tilestack demo", description=__doc__.split("\n")[0])
    p.add_argument("--examples", action="store_true", help="run every installed package's README example instead")
    p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    p.add_argument("--context", type=int, help="context tokens (default 4096 on CPU, 32768 on CUDA)")
    p.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per request")
    p.add_argument("--top-k", type=int, help="sparse block budget per kv head (default 1/16 of the blocks)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 when the load average "
                                               "exceeds the cores)")
    args = p.parse_args(argv)
    if args.examples:
        return run_examples()
    try:
        import tilestack.hf  # noqa: F401
    except ImportError as e:
        print(f"tilestack demo: {e}", file=sys.stderr)
        return 1
    run(args.device, args.context, args.new_tokens, args.top_k, json_path=args.json, threads=args.threads)
    return 0

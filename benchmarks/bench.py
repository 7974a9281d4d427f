"""Throughput of differential attention against a plain Llama of the same size, on one GPU.

    python benchmarks/bench.py --seq 2048 8192 --out benchmarks/results.json               (every phase)
    python benchmarks/bench.py --phases prefill decode --seq 2048 8192 32768 --out steps.json
                                        (prefill, chunked prefill at 32K, StaticCache steps with roofline share)
    python benchmarks/bench.py --phases generate --out generate.json            (generate(), the four paths)
    python benchmarks/bench.py --phases generate --generate-batch 1 --out generate_b1.json   (half of it, where
                                        one call of the device must stay short: the static paths' compiles)
    python benchmarks/bench.py --phases train --seq 2048 8192 32768 65536 --repeats 3 \
        --models llama-liger v1 v2 dex v1-liger v2-liger dex-liger          (the training table against Liger)
    python benchmarks/bench.py --phases prefill --seq 32768 --models v2 --attention fused_diff
                                        (V2 on the flash-diff kernel, where `sdpa` gives its prefill cuDNN's
                                        attention beyond 4096 keys; its training takes the kernel either way)
    python benchmarks/bench.py --phases train --seq 2048 --repeats 10 --passes 3 --models llama-liger v1-liger
                                        (each model in 3 processes, in turn: ratios paired within a pass)

Per sequence length, for transformers' LlamaForCausalLM (the reference), the same Llama with modeling_diff's
RMSNorm and RoPE kernels patched in (`llama-fused`: what the differential modes are compared with like for like,
since they use those kernels too), the same Llama with Liger's kernels (`llama-liger`: `apply_liger_kernel_to_llama()`
before it is built, as a user who trains with `use_liger_kernel=True` gets it), transformers' DiffLlamaForCausalLM
and modeling_diff's V1, V2 and DEX (the ~1.1B presets: hidden 2048, 16 layers, MLP 8192, bf16, sdpa, which on CUDA
routes to the project's fast paths), and V1, V2, DEX with `apply_liger_kernel_to_diff_llama(model=...)`
(`v1-liger`, ...), each model in a fresh process (Liger's patches are process-wide):

- train:    forward + backward + fused AdamW step on `tokens` tokens (4 x 2048, or 1 x 8192), peak memory;
- prefill:  no-grad forward of the same tokens, logits of the last position only (as generate() does); and
            where `seq` > `--prefill-chunk` (4096), `prefill chunked`: a batch-1 prompt of `seq` tokens fed
            through a DynamicCache 4096 tokens per forward, each chunk attending to the cache before it;
- decode:   64 greedy steps after a prompt of `seq` tokens (prefilled 4096 tokens per forward) and 4 warm-up
            steps, batch 1 and 32, with a StaticCache (the step captured in a CUDA graph and replayed), one model
            at a time (a batch that does not fit is an out-of-memory row: batch 32 at 32K may not);
- dynamic:  the same at batch 32 with a DynamicCache (eager steps: at these sizes mostly Python and launch
            overhead, so the host CPU sets the pace), all models loaded and stepping in lockstep (see
            `bench_dynamic_lockstep`);
- generate: what a user calling it gets, `model.generate()` of `--generate-models` (llama, v1, v2, dex) on a
            random 512-token prompt, 128 new tokens, greedy, at batch 1 and 32, with the default DynamicCache and
            with `cache_implementation="static"` (Llama: transformers compiles the step; ours: a CUDA graph per
            step): tok/s = batch x 128 / the wall seconds of one call; one warm-up call per (model, path), then 3 timed rounds, the models in lockstep
            (see `bench_generate_lockstep`); the tok/s cell gives the median and the range over the rounds.

Each row gives tok/s, the ratio to Llama, the work per token relative to Llama (model FLOPs for train and
prefill, bytes read for decode: weights / batch + the KV cache, counted analytically from the shapes) and
the efficiency = (tok/s ratio) x (work ratio): the share of Llama's useful FLOP/s (or bytes/s) reached, and
the tok/s ratio to `llama-fused`. The decoding rows also give their `roofline share`: the floor of a step = the
bytes it reads / the device's copy bandwidth (2 x bytes / time of a 1 GiB device-to-device copy, measured at the
start of the same run, ~4.2 TB/s on the H200), over the measured step time. The bytes of a step are every weight
but the embedding table (`weight_bytes`) + the KV cache of the positions up to the current length, averaged over
the timed steps (`decode_work` x batch); the StaticCache holds the prompt + 4 + 64 positions, so a kernel that
reads all of it every step reads up to 32 positions more than counted (under 2% of the cache at 2K). The JSON
rows carry `step_ms`, `floor_ms`, `roofline_share` and `bandwidth_tbs`. The generate rows' `seq` is their prompt
length. A second table gives the training rows against `llama-liger`: MFU (the model's FLOPs per token x tok/s over
the bf16 matmul peak of the same run: the higher of a reading at its start and one after its rows), tok/s and peak
memory ratios.

With `--passes N` the train, prefill and decode rows are measured N times, each pass running every model in a fresh
process, the models' order rotated from pass to pass (so that none always runs first or last on a warming machine).
A row then gives the median tok/s and the range over the passes; the training table's ratio to `llama-liger` is the
median of the passes' own ratios (each model against llama-liger of the same pass), with their range.
"""

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers import DiffLlamaConfig as HFDiffLlamaConfig
from transformers import DiffLlamaForCausalLM as HFDiffLlamaForCausalLM
from transformers.models.llama import modeling_llama

from modeling_diff import DiffLlamaForCausalLM, apply_liger_kernel_to_diff_llama, preset_config
from modeling_diff.kernels import apply_rope, greedy_tokens, rms_norm

MODELS = ("llama", "llama-fused", "llama-liger", "hf-diffllama", "v1", "v2", "dex", "v1-liger", "v2-liger", "dex-liger")
DEFAULT_MODELS = ("llama", "llama-fused", "hf-diffllama", "v1", "v2", "dex")  # Liger's: name them (liger-kernel)
GENERATE_MODELS = ("llama", "v1", "v2", "dex")
LLAMAS = ("llama", "llama-fused", "llama-liger")
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)


def fused_llama_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Llama RoPE call (q, k as (B, H, L, d)) through modeling_diff's kernel."""
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, fused=True)
    return q.transpose(1, 2), k.transpose(1, 2)


@contextlib.contextmanager
def kernels_patched(name: str):
    """While `llama-fused` runs, transformers' Llama computes RoPE with modeling_diff's kernel."""
    original = modeling_llama.apply_rotary_pos_emb
    if name == "llama-fused":
        modeling_llama.apply_rotary_pos_emb = fused_llama_rope
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = original


def mode_of(name: str) -> str:
    """The architecture behind a model name: "v1-liger" -> "v1", "llama-fused" -> "llama"."""
    return "llama" if name in LLAMAS else name.removesuffix("-liger")


def build(name: str, max_positions: int, attention: str = "sdpa"):
    """The model `name` in bf16 on the GPU; Llama and transformers' DiffLlama: 32 heads of 64, 8 kv heads.
    `attention`: the attn_implementation of modeling_diff's models (`fused_diff`: V1 and V2 on the flash-diff kernel)."""
    common = dict(SHAPE, max_position_embeddings=max_positions)
    if name == "llama-liger":  # Liger's RMSNorm, SwiGLU MLP, RoPE and fused linear cross-entropy in Llama's classes
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    if name in LLAMAS:
        cls, config = LlamaForCausalLM, LlamaConfig(**common, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    elif name == "hf-diffllama":
        cls, config = HFDiffLlamaForCausalLM, HFDiffLlamaConfig(**common, num_attention_heads=32, num_key_value_heads=8)
    else:
        config = preset_config(f"1.1b-{mode_of(name)}", max_position_embeddings=max_positions)
        cls = DiffLlamaForCausalLM
    config._attn_implementation = "sdpa" if cls is not DiffLlamaForCausalLM else attention
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(config)  # fp32 modules (V1's lambdas) keep their explicit dtype
    finally:
        torch.set_default_dtype(torch.float32)
    if name == "llama-fused":  # every LlamaRMSNorm through modeling_diff's kernel
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.forward = lambda x, m=module: rms_norm(x, m.weight, m.variance_epsilon)
    if name.endswith("-liger") and name != "llama-liger":
        apply_liger_kernel_to_diff_llama(model=model)
    # Parameters created outside the device context (V1's lambdas) follow. In eval mode, as from_pretrained gives a
    # model (bench_train puts it in training mode for its steps): the prefill and decoding rows are inference's.
    return model.to("cuda").eval()


def attention_work(name: str, config) -> tuple[float, float]:
    """(FLOPs per token per cached position, KV bytes per position), summed over layers, forward only."""
    layers, name = config.num_hidden_layers, mode_of(name)
    if name in ("v1", "hf-diffllama"):  # h differential heads (2h heads of d in transformers' config): 2 maps each
        h = config.num_attention_heads if name == "v1" else config.num_attention_heads // 2
        d = config.head_dim
        flops = 2 * h * 2 * (d + 2 * d)  # per map: Q.K over d, P.V over 2d
    elif name == "v2":
        flops = 2 * 2 * config.num_attention_heads * (2 * config.head_dim)  # 2h query heads of d
    else:  # llama, dex
        flops = 2 * config.num_attention_heads * (2 * config.head_dim)
    kv_bytes = 2 * config.num_key_value_heads * config.head_dim * 2  # K and V, bf16 (V1: h_kv heads of 2d)
    if name == "v1":
        kv_bytes *= 2
    return layers * flops, layers * kv_bytes


def linear_flops(model, name: str) -> tuple[float, float]:
    """(FLOPs per token of the decoder's linear maps, of the lm_head), forward."""
    body = 0.0
    for module_name, module in model.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            uses = model.config.num_attention_heads if module_name.endswith("dex_proj") else 1  # d x d per head
            body += 2 * module.weight.numel() * uses
    return body, 2 * model.lm_head.weight.numel()


def weight_bytes(model) -> float:
    """Bytes of every weight a decoding step reads (all but the embedding table, of which it reads a row)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def decode_work(name: str, model, batch: int, seq: int, new_tokens: int) -> float:
    """Bytes a decoding step reads per token, on average over the generation: the weights / batch + the KV cache
    (4 warm-up steps, then `new_tokens` timed ones, after a prompt of `seq`)."""
    _, kv_bytes = attention_work(name, model.config)
    return weight_bytes(model) / batch + kv_bytes * (seq + 4 + new_tokens / 2)


def cuda_time(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def bench_train(model, batch, seq, repeats, use_cache=None):
    """(tok/s, peak GiB) of training steps; `use_cache`: what the step passes (None: the model's default, which for
    modeling_diff's models in training is no cache, and for transformers' a DynamicCache)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        loss = model(ids, labels=ids, use_cache=use_cache).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up (allocates the optimizer state)
    torch.cuda.reset_peak_memory_stats()
    seconds = cuda_time(step, repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del optimizer
    model.zero_grad(set_to_none=True)
    model.eval()
    return batch * seq / seconds, peak


@torch.no_grad()
def bench_prefill(model, batch, seq, repeats):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    run = lambda: model(ids, use_cache=False, logits_to_keep=1)  # noqa: E731
    run()
    return batch * seq / cuda_time(run, repeats)


class DecodingSteps:
    """Prefill `cache` with a random prompt, fed in chunks of `chunk_tokens` tokens per forward (batch x chunk
    length); each call is then one greedy decoding step, its argmax through `greedy_tokens` for every model (as
    generate()'s graph chooses). The step reads and updates only device tensors, so it can be replayed as a CUDA
    graph; `rewind()` takes a DynamicCache back to the prompt."""

    @torch.no_grad()
    def __init__(self, model, cache, batch: int, prompt_len: int, chunk_tokens: int):
        self.model, self.cache, self.prompt_len = model, cache, prompt_len
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
        for chunk in prompt.split(max(1, chunk_tokens // batch), dim=1):
            logits = model(chunk, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        self.token = logits[:, -1].argmax(-1, keepdim=True)
        self.position = torch.full((batch, 1), prompt_len, device="cuda")

    @torch.no_grad()
    def __call__(self):
        logits = self.model(self.token, position_ids=self.position, past_key_values=self.cache, use_cache=True).logits
        greedy_tokens(logits[:, -1], out=self.token[:, 0], owner=self)  # argmax in one launch, as generate()'s graph
        self.position.add_(1)

    def rewind(self):
        extra = self.cache.get_seq_length() - self.prompt_len
        if extra:
            self.cache.crop(-extra)  # a negative count: the tokens to drop
        self.position.fill_(self.prompt_len)


def warm_up_steps(step, steps: int) -> None:
    """Untimed steps, off the default stream (as CUDA graph capture wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            step()
    torch.cuda.current_stream().wait_stream(side)


def bench_chunked_prefill(model, prompt_len, chunk_tokens, repeats) -> float:
    """tok/s of a batch-1 prompt fed through a DynamicCache `chunk_tokens` at a time (every chunk attends to the
    cache of the chunks before it), the last position's logits of each chunk, as `DecodingSteps` prefills."""
    run = lambda: DecodingSteps(model, DynamicCache(config=model.config), 1, prompt_len, chunk_tokens)  # noqa: E731
    run()
    return prompt_len / cuda_time(run, repeats)


@torch.no_grad()
def bench_static_decode(model, batch, prompt_len, new_tokens, chunk_tokens) -> float:
    """tok/s of greedy StaticCache steps after the prompt, the step captured once in a CUDA graph and replayed
    (what generate() gets from compiling the static-cache step: no per-step Python and launch overhead)."""
    warmup = 4
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + warmup + new_tokens)
    step = DecodingSteps(model, cache, batch, prompt_len, chunk_tokens)
    warm_up_steps(step, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = cuda_time(graph.replay, new_tokens)
    del cache, graph
    return batch / seconds


def rotated(names, i: int) -> list:
    """`names` starting at its i-th (modulo its length): the order of the models in lockstep round or step i."""
    return names[i % len(names):] + names[: i % len(names)]


@torch.no_grad()
def bench_dynamic_lockstep(names, seq: int, args, batch: int = 32) -> list[dict]:
    """The `decode b32 dynamic` rows: eager DynamicCache steps, whose pace the host CPU sets, and the H200 machine's
    host drifted by up to 1.5x within minutes. So the models run in lockstep: all are loaded with their own
    prefilled cache, every step of the generation runs once per model, in an order rotated every step, and each
    step is timed from a synchronized start to a synchronized end (generate() synchronizes every step too, for
    its stopping check). A round is one generation per model (4 untimed steps, then `new_tokens` timed ones), the
    caches rewound to the prompt between rounds. The first round is untimed: it compiles kernels, and
    transformers' cuDNN attention builds a plan for every new cache length (3-4 ms of CPU per call), which later
    rounds find cached. A row is the median over the timed rounds."""
    steps = {}
    for name in names:
        with kernels_patched(name):
            model = build(name, max_positions=seq + 128)
            steps[name] = DecodingSteps(model, DynamicCache(config=model.config), batch, seq, args.prefill_chunk)
    warmup = 4
    speeds = {name: [] for name in names}
    for round_ in tqdm(range(1 + args.rounds), desc=f"seq {seq} dynamic rounds"):
        elapsed = dict.fromkeys(names, 0.0)
        for step in steps.values():
            step.rewind()
        for i in range(warmup + args.new_tokens):
            for name in rotated(names, i):
                with kernels_patched(name):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    steps[name]()
                    torch.cuda.synchronize()
                    if i >= warmup:
                        elapsed[name] += time.perf_counter() - start
        if round_ > 0:
            for name in names:
                speeds[name].append(batch * args.new_tokens / elapsed[name])
    rows = []
    for name, step in steps.items():
        rows.append(dict(seq=seq, model=name, phase=f"decode b{batch} dynamic", batch=batch,
                         tok_s=statistics.median(speeds[name]), rounds=speeds[name],
                         work=decode_work(name, step.model, batch, seq, args.new_tokens)))
        tqdm.write(json.dumps(rows[-1]))
    del steps, step
    gc.collect()
    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def graph_phases_timed():
    """-> a dict that gets the wall ms of the whole-step graph path's prompt (`GreedyStepGraph.prefill`: the
    eager prefill and the first choice) and steps (`run`: the replays, and the capture where it happens), each
    synchronized before and after, for the generate() calls inside the block: the rest of a call is the host's
    work around them (generate's arguments and config, the graph's key, the output)."""
    from modeling_diff.generation import GreedyStepGraph

    timed, saved = {}, (GreedyStepGraph.prefill, GreedyStepGraph.run)

    def timing(field, method):
        def wrapper(self, *args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = method(self, *args, **kwargs)
            torch.cuda.synchronize()
            timed[field] = timed.get(field, 0.0) + (time.perf_counter() - start) * 1e3
            return result
        return wrapper

    GreedyStepGraph.prefill, GreedyStepGraph.run = timing("prefill_ms", saved[0]), timing("steps_ms", saved[1])
    try:
        yield timed
    finally:
        GreedyStepGraph.prefill, GreedyStepGraph.run = saved


@torch.no_grad()
def bench_generate_lockstep(names, paths, args) -> list[dict]:
    """The `generate b* dynamic|static` rows: what a user calling `model.generate()` gets, tok/s = batch x
    `generate_new_tokens` / the wall seconds of one call (synchronized before and after), greedy with no early
    stop, on a random prompt of `generate_prompt` tokens; with the default DynamicCache (eager steps) or with
    `cache_implementation="static"` (transformers compiles Llama's decoding step, "reduce-overhead": CUDA graphs;
    modeling_diff's models replay their whole-step graph, `modeling_diff/generation.py`).
    The host's speed drifts, so the models run in lockstep: all are loaded in this process, one untimed call per
    (model, path) first (in `paths` order, so each model compiles its static step once per batch size, batch 32
    after batch 1, as for a user generating at both), then `generate_rounds` timed rounds of one call per (model,
    path), the models' order rotated every round. A row is the median over the rounds, `rounds` their speeds; the
    static rows of modeling_diff's models also `phases_ms`, one more call split into its prompt, its steps and the
    rest (`graph_phases_timed`)."""
    models = {}
    for name in names:
        with kernels_patched(name):
            models[name] = build(name, max_positions=args.generate_prompt + args.generate_new_tokens)
    vocab = min(model.config.vocab_size for model in models.values())
    prompts = {batch: torch.randint(0, vocab, (batch, args.generate_prompt), device="cuda") for _, batch in paths}

    def generate(name: str, phase: str, batch: int) -> float:
        model, ids, new = models[name], prompts[batch], args.generate_new_tokens
        static = {"cache_implementation": "static"} if phase.endswith("static") else {}
        with kernels_patched(name):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=model.config.eos_token_id, **static)
            torch.cuda.synchronize()
        return batch * new / (time.perf_counter() - start)

    errors, speeds = {}, {(name, phase): [] for name in names for phase, _ in paths}
    with tqdm(total=len(names) * len(paths), desc="generate warm-up (compiles the static paths)") as bar:
        for phase, batch in paths:
            for name in names:
                try:
                    generate(name, phase, batch)
                except (torch.OutOfMemoryError, RuntimeError) as error:  # the row notes it, the others go on
                    errors[name, phase] = f"{type(error).__name__}: {str(error)[:100]}"
                bar.update()
    for round_ in tqdm(range(args.generate_rounds), desc="generate rounds"):
        for phase, batch in paths:
            for name in rotated(names, round_):
                if (name, phase) not in errors:
                    speeds[name, phase].append(generate(name, phase, batch))
    phases = {}  # (name, phase) -> where one more static call of ours spent its wall time
    for phase, batch in paths:
        for name in names:
            if phase.endswith("static") and name not in LLAMAS and (name, phase) not in errors:
                with graph_phases_timed() as phases[name, phase]:
                    tokens_per_s = generate(name, phase, batch)
                phases[name, phase]["call_ms"] = batch * args.generate_new_tokens / tokens_per_s * 1e3
    rows = []
    for phase, batch in paths:
        for name in names:
            row = dict(seq=args.generate_prompt, model=name, phase=phase, batch=batch)
            if (name, phase) in errors:
                row["error"] = errors[name, phase]
            else:
                row.update(tok_s=statistics.median(speeds[name, phase]), rounds=speeds[name, phase])
            if (name, phase) in phases:
                row["phases_ms"] = phases[name, phase]
            rows.append(row)
            tqdm.write(json.dumps(row))
    return rows


def profiling_args(parser, argv, positive: tuple, script: str):
    """The profiling scripts' arguments, checked: the `positive` counts >= 1, a CUDA GPU, the --out folder made."""
    args = parser.parse_args(argv)
    for field in positive:
        if getattr(args, field) < 1:
            parser.error(f"--{field} must be >= 1")
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    return args


def warm_up_gpu(seconds: float = 3.0):
    """Bring the clocks up before the first measurement (the first model would otherwise pay for it)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def matmul_peak(n: int = 8192) -> tuple[float, float]:
    """FLOP/s of a bf16 (n x n) @ (n x n) product on random data: (burst, sustained). Burst = the median of 5
    rounds of 10 products after 3 untimed ones (the device notes' method, ~790 TFLOP/s on the H200): MFU's
    denominator. Sustained = the same after 3 s of products, when power limits the clocks (about 15% lower)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rate = lambda: statistics.median(2 * n**3 / cuda_time(lambda: a @ b, 10) for _ in range(5))  # noqa: E731
    cuda_time(lambda: a @ b, 3)
    burst = rate()
    warm_up_gpu()
    return burst, rate()


def copy_bandwidth(gib: int = 1) -> float:
    """Bytes/s of a device-to-device copy of `gib` GiB (read once, written once: 2 x bytes / time), the median of 5
    rounds of 10 copies after 3 untimed ones (~4.2 TB/s on the H200): the decoding roofline's denominator."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cuda_time(lambda: dst.copy_(src), 3)
    return statistics.median(2 * src.numel() / cuda_time(lambda: dst.copy_(src), 10) for _ in range(5))


def device_peaks() -> tuple[float, float, float]:
    """(burst matmul FLOP/s, sustained matmul FLOP/s, copy bytes/s), measured in one process."""
    return *matmul_peak(), copy_bandwidth()


def train_batch(seq: int, args) -> int:
    """Sequences per training or prefill batch: --tokens in all, at least one."""
    return max(1, args.tokens // seq)


def bench_model(name: str, seq: int, phases, args) -> list[dict]:
    """The rows of one model at one sequence length."""
    batch = train_batch(seq, args)
    model = build(name, max_positions=seq + 128, attention=args.attention)
    body, head = linear_flops(model, name)
    attn_flops, _ = attention_work(name, model.config)
    rows = []
    for phase, dec_batch in phases:
        if not applies(phase, seq, args):
            continue
        row = dict(seq=seq, model=name, phase=phase, batch=batch if phase in ("train", "prefill") else dec_batch)
        try:
            if phase == "train":
                row["tok_s"], row["peak_gib"] = bench_train(model, batch, seq, args.repeats, args.train_use_cache)
                if args.train_use_cache:
                    row["use_cache"] = True
                row["work"] = 3 * (body + head + attn_flops * (seq + 1) / 2)
            elif phase == "prefill":
                row["tok_s"] = bench_prefill(model, batch, seq, args.repeats)
                row["work"] = body + head / seq + attn_flops * (seq + 1) / 2
            elif phase == "prefill chunked":
                row["tok_s"] = bench_chunked_prefill(model, seq, args.prefill_chunk, args.repeats)
                row["work"] = body + head * math.ceil(seq / args.prefill_chunk) / seq + attn_flops * (seq + 1) / 2
            else:
                row["tok_s"] = bench_static_decode(model, dec_batch, seq, args.new_tokens, args.prefill_chunk)
                row["work"] = decode_work(name, model, dec_batch, seq, args.new_tokens)
        except (torch.OutOfMemoryError, RuntimeError) as error:  # recorded in the table, the run goes on
            row["error"] = f"{type(error).__name__}: {str(error)[:100]}"
        rows.append(row)
        tqdm.write(json.dumps(row))
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


# (row name, batch of the decoding or generate row) in table order; the --phases choice of each: `choice(row name)`
PHASES = [("train", None), ("prefill", None), ("prefill chunked", 1), ("decode b1 static", 1),
          ("decode b32 dynamic", 32), ("decode b32 static", 32), ("generate b1 dynamic", 1),
          ("generate b1 static", 1), ("generate b32 dynamic", 32), ("generate b32 static", 32)]


def applies(phase: str, seq: int, args) -> bool:
    """Whether a row is measured at `seq`: the chunked prefill only where the prompt takes more than one chunk."""
    return phase != "prefill chunked" or seq > args.prefill_chunk


def choice(phase: str) -> str:
    """The --phases choice that runs a row: its first word, "dynamic" for the DynamicCache decoding steps."""
    return "dynamic" if phase == "decode b32 dynamic" else phase.split()[0]


def bench_model_all_lengths(name: str, phases, args) -> list[dict]:
    """Every length's rows of one model, in this (fresh) process."""
    torch.backends.cuda.matmul.allow_tf32 = True
    warm_up_gpu(1.0)  # the clocks of the machine were brought up by the matmul peak's process
    rows = []
    for seq in args.seq:
        with kernels_patched(name):
            rows += bench_model(name, seq, phases, args)
    return rows


def in_fresh_process(fn, *args):
    """fn(*args) in a new Python process: `apply_liger_kernel_to_llama()` patches transformers' Llama for the rest of
    its process, and every model starts with an empty CUDA allocator."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def rows_or_errors(fn, fn_args, failed: list[dict]) -> list[dict]:
    """fn(*fn_args)'s rows, run in a fresh process; if it fails (a model not built: liger-kernel missing; out of
    memory outside a row's own check; the process died), the rows `failed` with the error noted: the run goes on."""
    try:
        return in_fresh_process(fn, *fn_args)
    except Exception as error:
        reason = "process died" if isinstance(error, BrokenProcessPool) else type(error).__name__
        return [dict(row, error=f"{reason}: {str(error)[:100]}") for row in failed]


def run(args) -> tuple[list[dict], float, float]:
    """The rows, sorted, the (burst) matmul peak in FLOP/s (the higher of a reading before the rows and one after)
    and the copy bandwidth in bytes/s, measured first."""
    peak, sustained, bandwidth = in_fresh_process(device_peaks)
    tqdm.write(f"bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s (sustained after 3 s: {sustained / 1e12:.0f}), "
               f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    one_at_a_time = [(p, b) for p, b in PHASES if choice(p) in set(args.phases) & {"train", "prefill", "decode"}]
    results = []
    if one_at_a_time:
        passes = []
        for index in tqdm(range(args.passes), desc="passes", disable=args.passes == 1):
            rows = []
            for name in tqdm(rotated(args.models, index), desc="models"):
                failed = [dict(seq=seq, model=name, phase=p, batch=b or train_batch(seq, args))
                          for seq in args.seq for p, b in one_at_a_time if applies(p, seq, args)]
                rows += rows_or_errors(bench_model_all_lengths, (name, one_at_a_time, args), failed)
            passes.append(rows)
        results += merged_passes(passes)
    lockstep = [name for name in args.models if not name.endswith("-liger")]  # Liger's patches are process-wide
    if "dynamic" in args.phases:
        batch = next(b for p, b in PHASES if choice(p) == "dynamic")
        for seq in args.seq:
            failed = [dict(seq=seq, model=name, phase=f"decode b{batch} dynamic") for name in lockstep]
            results += rows_or_errors(bench_dynamic_lockstep, (lockstep, seq, args, batch), failed)
    if "generate" in args.phases:
        paths = [(p, b) for p, b in PHASES if choice(p) == "generate" and b in args.generate_batch]
        failed = [dict(seq=args.generate_prompt, model=name, phase=p) for p, _ in paths
                  for name in args.generate_models]
        results += rows_or_errors(bench_generate_lockstep, (args.generate_models, paths, args), failed)
    # Runs minutes apart on one H200 read the burst rate at 798 and 744 TFLOP/s while the models' tok/s held within
    # 1%: read again after the rows, MFU takes the higher reading (the lower would flatter it).
    again, _ = in_fresh_process(matmul_peak)
    tqdm.write(f"bf16 matmul peak after the rows: {again / 1e12:.0f} TFLOP/s; MFU of {max(peak, again) / 1e12:.0f}")
    order, names = [p for p, _ in PHASES], list(dict.fromkeys(args.models + args.generate_models))
    key = lambda r: (r["seq"], names.index(r["model"]), order.index(r["phase"]))  # noqa: E731
    return sorted(results, key=key), max(peak, again), bandwidth


def merged_passes(passes: list[list[dict]]) -> list[dict]:
    """The rows of several passes (each a list of rows, every model once) as one row per (seq, model, phase): the
    median tok/s, `passes` = each pass's tok/s in pass order, the highest peak memory; a row that failed in any pass
    keeps the first error. One pass: its rows as they are."""
    if len(passes) == 1:
        return passes[0]
    by_key: dict[tuple, list[dict]] = {}
    for rows in passes:
        for row in rows:
            by_key.setdefault((row["seq"], row["model"], row["phase"]), []).append(row)
    merged = []
    for rows in by_key.values():
        failed = [r for r in rows if "tok_s" not in r]
        if failed:
            merged.append(failed[0])
            continue
        row = dict(rows[0], passes=[r["tok_s"] for r in rows], tok_s=statistics.median(r["tok_s"] for r in rows))
        if "peak_gib" in row:
            row["peak_gib"] = max(r["peak_gib"] for r in rows)
        merged.append(row)
    return merged


def speed_cell(row: dict) -> str:
    """tok/s, followed by the range over the timed rounds or passes where a row has several: `414 (402-420)`."""
    fmt = lambda v: f"{v / 1000:.1f}k" if v >= 10000 else f"{v:.0f}"  # noqa: E731
    rounds = row.get("rounds") or row.get("passes") or []
    return fmt(row["tok_s"]) + (f" ({fmt(min(rounds))}-{fmt(max(rounds))})" if len(rounds) > 1 else "")


def liger_ratio_cell(row: dict, ref: dict) -> str:
    """tok/s against llama-liger's row: the median of the passes' own ratios and their range where both rows have
    the same passes, else the ratio of the two rows."""
    ours, theirs = row.get("passes", []), ref.get("passes", [])
    if len(ours) > 1 and len(ours) == len(theirs):
        ratios = [a / b for a, b in zip(ours, theirs)]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    return f"{row['tok_s'] / ref['tok_s']:.2f}x"


def table(results) -> str:
    """Markdown table: ratios against the Llama row of the same sequence length and phase (and, for the
    differential modes, against `llama-fused` and transformers' DiffLlama); the decoding rows' roofline share.
    The generate rows count no work (their time mixes the prompt's forward and the steps)."""
    rows_of = lambda model: {(r["seq"], r["phase"]): r for r in results if r["model"] == model and "tok_s" in r}  # noqa: E731
    base, fused, hf = rows_of("llama"), rows_of("llama-fused"), rows_of("hf-diffllama")
    lines = ["| seq | phase | model | tok/s | vs Llama | work vs Llama | efficiency | roofline share | vs Llama-fused "
             "| vs HF DiffLlama | peak GiB (vs Llama) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        key, ref = (r["seq"], r["phase"]), base.get((r["seq"], r["phase"]))
        if "tok_s" not in r:
            lines.append(f"| {r['seq']} | {r['phase']} | {r['model']} | {r.get('error', 'n/a')} | | | | | | | |")
            continue
        if ref is None:  # no Llama row at this length and phase in the run: the row's own numbers
            peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else ""
            lines.append(f"| {r['seq']} | {r['phase']} | {r['model']} | {speed_cell(r)} | | | | | | | {peak} |")
            continue
        speed = r["tok_s"] / ref["tok_s"]
        work = f"{r['work'] / ref['work']:.2f}" if "work" in r else ""
        efficiency = f"{speed * r['work'] / ref['work']:.2f}" if "work" in r else ""
        roofline = f"{r['roofline_share']:.2f}" if "roofline_share" in r else ""
        mode = r["model"] in ("v1", "v2", "dex")
        vs_fused = f"{r['tok_s'] / fused[key]['tok_s']:.2f}x" if key in fused and mode else ""
        vs_hf = f"{r['tok_s'] / hf[key]['tok_s']:.2f}x" if key in hf and r["model"] == "v1" else ""
        peak = f"{r['peak_gib']:.1f} ({r['peak_gib'] / ref['peak_gib']:.2f}x)" if "peak_gib" in r else ""
        lines.append(f"| {r['seq']} | {r['phase']} | {r['model']} | {speed_cell(r)} | {speed:.2f}x | {work} | "
                     f"{efficiency} | {roofline} | {vs_fused} | {vs_hf} | {peak} |")
    return "\n".join(lines)


def train_table(results, peak: float) -> str:
    """Markdown table of the training rows: MFU = FLOPs per token (`work`) x tok/s / the measured matmul peak, and
    tok/s and peak memory against `llama-liger` at the same length."""
    train = [r for r in results if r["phase"] == "train"]
    liger = {r["seq"]: r for r in train if r["model"] == "llama-liger" and "tok_s" in r}
    lines = [f"| seq x batch | model | train tok/s | MFU (of {peak / 1e12:.0f} TFLOP/s) | tok/s vs llama-liger | "
             "peak GiB | memory vs llama-liger |", "|---|---|---|---|---|---|---|"]
    for r in train:
        shape = f"{r['seq']} x {r['batch']}"
        if "tok_s" not in r:
            error = r.get("error", "n/a")
            lines.append(f"| {shape} | {r['model']} | "
                         f"{'out of memory' if error.startswith('OutOfMemoryError') else error} | | | | |")
            continue
        ref = liger.get(r["seq"])
        speed = liger_ratio_cell(r, ref) if ref else ""
        memory = f"{r['peak_gib'] / ref['peak_gib']:.2f}x" if ref else ""
        lines.append(f"| {shape} | {r['model']} | {speed_cell(r)} | {r['mfu']:.3f} | {speed} | "
                     f"{r['peak_gib']:.1f} | {memory} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=MODELS,
                        help="the *-liger models need liger-kernel (the [liger] extra)")
    parser.add_argument("--phases", nargs="+", default=["train", "prefill", "decode", "dynamic", "generate"],
                        choices=["train", "prefill", "decode", "dynamic", "generate"],
                        help="prefill: one forward, and chunked where seq > --prefill-chunk; decode: the StaticCache "
                             "steps; dynamic: the DynamicCache steps, models in lockstep; generate: model.generate() "
                             "of --generate-models in lockstep")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per training / prefill batch")
    parser.add_argument("--train-use-cache", action="store_true", default=None,
                        help="training steps pass use_cache=True: every model builds and writes a DynamicCache, as "
                             "transformers' do by default (modeling_diff's build none in training unless asked)")
    parser.add_argument("--prefill-chunk", type=int, default=4096,
                        help="tokens per forward (batch x chunk length) when a prompt is fed through a cache")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=1,
                        help="train, prefill and decode rows: every model measured in this many fresh processes, "
                             "in rotated order; medians, ranges and paired ratios to llama-liger")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of the dynamic rows (models in lockstep)")
    parser.add_argument("--generate-models", nargs="+", default=list(GENERATE_MODELS),
                        choices=[m for m in MODELS if not m.endswith("-liger")])
    parser.add_argument("--generate-batch", type=int, nargs="+", default=[1, 32], choices=[1, 32])
    parser.add_argument("--generate-prompt", type=int, default=512, help="prompt tokens of the generate rows")
    parser.add_argument("--generate-new-tokens", type=int, default=128)
    parser.add_argument("--generate-rounds", type=int, default=3, help="timed rounds of the generate rows")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "fused_diff"],
                        help="train, prefill and decode rows: the attn_implementation of modeling_diff's models "
                             "(sdpa, their default on CUDA; fused_diff: V1 and V2 on the flash-diff kernel at every "
                             "length)")
    parser.add_argument("--out", help="write the rows (JSON) and the table (.md beside it) here")
    args = parser.parse_args(argv)
    for name in ("seq", "tokens", "prefill_chunk", "new_tokens", "repeats", "passes", "rounds", "generate_prompt",
                 "generate_new_tokens", "generate_rounds"):
        values = getattr(args, name) if isinstance(getattr(args, name), list) else [getattr(args, name)]
        if any(v < 1 for v in values):
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    results, peak, bandwidth = run(args)
    for r in results:
        if r["phase"] == "train" and "tok_s" in r:
            r["mfu"], r["matmul_peak_tflops"] = r["work"] * r["tok_s"] / peak, peak / 1e12
        if r["phase"].startswith("decode") and "tok_s" in r:  # bytes per step = batch x bytes per token (`work`)
            r["step_ms"], r["floor_ms"] = 1e3 * r["batch"] / r["tok_s"], 1e3 * r["batch"] * r["work"] / bandwidth
            r["roofline_share"], r["bandwidth_tbs"] = r["floor_ms"] / r["step_ms"], bandwidth / 1e12
    text = table(results)
    if "train" in args.phases:
        text += "\n\nTraining against llama-liger:\n\n" + train_table(results, peak)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n{text}")
    if args.out:
        write_atomically(args.out, json.dumps(results, indent=1))
        write_atomically(os.path.splitext(args.out)[0] + ".md", text)


def write_atomically(path: str, content: str) -> None:
    """Written whole to a temporary file beside `path`, then renamed into place."""
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False) as f:
        f.write(content + "\n")
    os.replace(f.name, path)


if __name__ == "__main__":
    main()

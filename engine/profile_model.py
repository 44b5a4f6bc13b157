"""A latency profile modelled from a measured one: another architecture's round times on the same device,
until that device measures them.

The measured profile's fitted ``RoundModel`` (engine/latency_profile.py) gives the device's rates as this
engine reaches them: ``weights_ms`` (its products' floor, the weights' read) over the weight bytes a forward
reads is the read rate; ``product_ms`` over the matrix parameters a token goes through is the product rate;
``pair_ms`` over its layers x query heads x head size is the attention rate; ``forward_ms`` the fixed cost of
a forward and ``step_ms`` a step's slot. A target ``Shape`` (an architecture) is priced at those rates
(``ModelledRounds``):

- **Products, bounded below by the weight read, per part.** The dense part (attention projections, dense
  MLPs, routers, shared experts, the LM head where a kind computes logits, DiffusionGemma's self-conditioning
  MLP and soft-embedding product on a denoising step) costs max(read, FLOPs): any forward reads all of it.
  The routed experts cost max(read of the experts a forward's tokens touch, FLOPs of the top-k experts per
  token): with T routed tokens and uniform routing a layer's tokens touch E x (1 - (1 - k/E)^T) of its E
  experts, so a few tokens read about the active parameters and a 256-token canvas nearly all of them.
  (``moe_efficiency`` > 1 would slow the experts' products; 1: at the dense products' rate.)
- **Attention per layer type**: query tokens x keys x (layers x query heads x head size) at the measured
  rate; a sliding-window layer's keys are capped at its window.
- **Logits**: a kind that decodes reads and writes [tokens, vocab] float32 logits ``vocab_passes`` times
  (cast, soft cap, temperature, sampling, entropy, argmax, the self-conditioning softmax), at the read rate.
- **Launches.** A forward this engine runs without CUDA graphs (DiffusionGemma's today; above the graph
  limit otherwise) costs at least the host's time to launch its kernels: kernels per layer (counted in this
  engine's code, ``KERNELS_PER_LAYER``) x layers x ``dispatch_ms_per_kernel``, fitted to the eager rounds of
  another measured run (``calibrate_dispatch``: the LLaDA2-mini H200 run's, 12.6 us per kernel); the device's
  work hides it where it is longer (``launch-bound`` is the excess).
- **Fixed**: ``forward_ms`` per forward, ``step_ms`` per step (a slot's host bookkeeping), as measured.

**Tensor parallelism** (``tp_shape``, ``model_profile(tp=d)``): each of d ranks holds its share of the query
heads, K/V heads (one per rank where there are fewer than ranks: replicated), the dense MLP's and every expert's
columns; the router, norms, embeddings, self-conditioning and LM head are replicated (as
``engine.models.diffusion_gemma.shard`` splits a checkpoint). A rank's forward is the model's priced on its shard
at the same device rates, plus ``reduces_per_layer`` all-reduces of the [tokens, hidden] bf16 activation per
layer (``AllReduce``: a fixed latency and the bytes a ring moves at a bus bandwidth; no repo run measured one:
the figures are published ones, stated in the profile's meta) and their launches (one kernel each, added to the
layer's). A rank launches as many kernels as a whole model does, so an eager, launch-bound round gains nothing
from TP and pays its all-reduces: the planner sees it in the TP profiles ``scripts/model_profile.py`` writes
beside the TP-1 one (``NAME-tp2.json``, ``NAME-tp4.json``: ``load_tp_profiles`` prefers them to TP-1's scaled).

``model_profile`` samples the model at the shapes a profile run measures (``remask profile``'s rounds:
batches of steps of one kind) and returns an ordinary ``LatencyProfile`` of those points, its ``meta``
saying it is modelled, how, and from what; the simulator and the planner price it as any profile (its
``RoundModel`` fitted to the points). ``scripts/model_profile.py`` writes the shipped one. A GPU run
(`remask profile` of the real checkpoint) replaces it.

Pure Python (no torch): the fit imports NumPy and SciPy as every profile's does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from engine.latency_profile import LatencyProfile, ProfilePoint, load_profile

BF16_BYTES = 2
FP32_BYTES = 4


@dataclass(frozen=True)
class AttentionLayers:
    """``layers`` attention layers of one type: query heads, K/V heads and head size; ``window``: a sliding
    window's keys (None: every key); ``k_eq_v``: keys are the values (no V projection)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    k_eq_v: bool = False

    def params(self, hidden: int) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim * (1 if self.k_eq_v else 2)
        return self.layers * hidden * (2 * q + kv)

    @property
    def unit(self) -> int:
        """layers x query heads x head size: what one (query token, key) pair costs, in the rate's units."""
        return self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class Shape:
    """An architecture as its costs see it. ``logits_kinds``: the step kinds whose forward computes logits
    for every query token; ``conditioning``: the kinds that also run DiffusionGemma's self-conditioning (a
    gated MLP of ``conditioning_intermediate`` and the [vocab, hidden] soft-embedding product);
    ``kernels_per_layer``: the kernels a layer launches (an eager forward's launches)."""

    name: str
    hidden: int
    vocab: int
    attention: tuple[AttentionLayers, ...]
    mlp_layers: int  # layers with a dense gated MLP (3 matrices of hidden x intermediate)
    intermediate: int
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    tied_embeddings: bool = False
    logits_kinds: tuple[str, ...] = ("denoise", "cached", "recompute")
    conditioning: tuple[str, ...] = ()
    conditioning_intermediate: int = 0
    kernels_per_layer: float = 1.0
    cuda_graphs: bool = True  # this engine replays the shape's forwards from CUDA graphs (below the limit)

    @property
    def layers(self) -> int:
        return sum(a.layers for a in self.attention)

    @property
    def expert_params(self) -> int:
        """Every routed expert's weights (gate, up, down)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def active_expert_params(self) -> int:
        return self.moe_layers * self.experts_per_token * 3 * self.hidden * self.moe_intermediate

    def dense_params(self, kind: str) -> int:
        """The matrices a token of ``kind`` goes through outside the routed experts (all read every forward)."""
        p = sum(a.params(self.hidden) for a in self.attention)
        p += self.mlp_layers * 3 * self.hidden * self.intermediate
        p += self.moe_layers * (self.hidden * self.experts + self.shared_experts * 3 * self.hidden
                                * self.moe_intermediate)
        if kind in self.logits_kinds:
            p += self.hidden * self.vocab
        if kind in self.conditioning:
            p += 3 * self.hidden * self.conditioning_intermediate + self.hidden * self.vocab
        return p

    @property
    def total_params(self) -> int:
        """Every weight matrix (embeddings once if tied): the published parameter count's terms."""
        emb = self.hidden * self.vocab * (1 if self.tied_embeddings else 2)
        return (sum(a.params(self.hidden) for a in self.attention) + self.mlp_layers * 3 * self.hidden
                * self.intermediate + self.moe_layers * (self.hidden * self.experts + self.shared_experts * 3
                                                         * self.hidden * self.moe_intermediate)
                + self.expert_params + emb + 3 * self.hidden * self.conditioning_intermediate)

    @property
    def active_params(self) -> int:
        """What one token goes through, embeddings included (the published "active" count's terms)."""
        return self.total_params - self.expert_params + self.active_expert_params - \
            3 * self.hidden * self.conditioning_intermediate

    def touched_experts(self, tokens: float) -> float:
        """The share of a layer's experts ``tokens`` routed tokens touch, routing uniform and independent."""
        if not self.experts or tokens <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens


def gemma_shape(text: dict, name: str, kernels_per_layer: float, canvas_kinds: tuple[str, ...] = ("denoise",)) \
        -> Shape:
    """A DiffusionGemma (Gemma-4 MoE) ``Shape`` from a checkpoint's ``text_config``: sliding layers with
    ``head_dim`` and ``num_key_value_heads``, full layers with ``global_head_dim`` and
    ``num_global_key_value_heads`` (keys are the values), a dense MLP beside the routed experts in every layer,
    tied embeddings; the encoder (prefill) computes no logits, a denoising step computes them and its
    self-conditioning."""
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {n}")
    sliding = sum(t == "sliding_attention" for t in types)
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    k_eq_v = bool(text.get("attention_k_eq_v", True))
    full_kv = int(text.get("num_global_key_value_heads") or text["num_key_value_heads"])
    attention = (AttentionLayers(sliding, heads, int(text["num_key_value_heads"]), int(text["head_dim"]),
                                 window=int(text["sliding_window"])),
                 AttentionLayers(n - sliding, heads, full_kv, int(text.get("global_head_dim") or text["head_dim"]),
                                 k_eq_v=k_eq_v))
    return Shape(name, hidden, int(text["vocab_size"]), attention, n, int(text["intermediate_size"]),
                 moe_layers=n, experts=int(text["num_experts"]), experts_per_token=int(text["top_k_experts"]),
                 moe_intermediate=int(text["moe_intermediate_size"]), tied_embeddings=True,
                 logits_kinds=canvas_kinds, conditioning=canvas_kinds,
                 conditioning_intermediate=int(text["intermediate_size"]), kernels_per_layer=kernels_per_layer,
                 cuda_graphs=False)


def preset_shape(preset: dict, name: str, kernels_per_layer: float) -> Shape:
    """A ``Shape`` from an ``engine.models.presets`` entry (the shapes the H200 runs measured)."""
    hd = preset.get("head_dim") or preset["hidden_size"] // preset["num_heads"]
    n = preset["num_layers"]
    moe = n - preset.get("dense_layers", 0) if preset.get("num_experts") else 0
    return Shape(name, preset["hidden_size"], preset["vocab_size"],
                 (AttentionLayers(n, preset["num_heads"], preset["num_kv_heads"], hd),), n - moe,
                 preset["intermediate_size"], moe_layers=moe, experts=preset.get("num_experts", 0),
                 experts_per_token=preset.get("experts_per_token", 0),
                 moe_intermediate=preset.get("moe_intermediate_size", 0),
                 shared_experts=preset.get("shared_experts", 0), kernels_per_layer=kernels_per_layer)


# ---------------------------------------------------------------- the published shapes

# google/diffusiongemma-26B-A4B-it's config.json, text_config (the Gemma-4 26B-A4B backbone): the fields the
# costs read. Its published counts: 25.2B parameters, 3.8B active (tests/test_profile_model.py checks them).
DG_26B_A4B_TEXT = {
    "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 2,
    "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144, "num_experts": 128,
    "top_k_experts": 8, "moe_intermediate_size": 704, "tie_word_embeddings": True,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
}
DG_CANVAS = 256  # its canvas_length

# engine.models.presets' shapes of the two H200 runs (tests/test_profile_model.py checks they match)
LLADA_8B = {"vocab_size": 126464, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32,
            "intermediate_size": 12288}
LLADA2_MINI = {"vocab_size": 157184, "hidden_size": 2048, "num_layers": 20, "num_heads": 16, "num_kv_heads": 4,
               "head_dim": 128, "intermediate_size": 5120, "num_experts": 256, "experts_per_token": 8,
               "moe_intermediate_size": 512, "shared_experts": 1, "dense_layers": 1}

# Kernels a layer's forward launches in this engine's code, counted as dispatched torch operators (views and
# metadata excluded) on a two-layer minus a one-layer CPU forward: ``scripts/model_profile.py --count-kernels``
# prints them. CUDA launches are close to these counts (a few fuse, a few split).
KERNELS_PER_LAYER = {"llada-8b-shape": 27.0, "llada2-mini-shape": 74.0, "diffusiongemma": 119.0}


# ---------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class AllReduce:
    """An all-reduce among ``world`` ranks of ``nbytes``: ``latency_ms`` + 2 (world - 1) / world x nbytes at
    ``bus_bytes_per_ms`` (a ring's bus bandwidth, the figure nccl-tests reports as busbw); ``source`` says where
    the two numbers come from."""

    latency_ms: float
    bus_bytes_per_ms: float
    source: str

    def ms(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        return self.latency_ms + 2.0 * (world - 1) / world * nbytes / self.bus_bytes_per_ms


# H200s of one HGX board share NVLink 4 through NVSwitch (900 GB/s per GPU, as the H100 SXM). No run of this repo
# measured an all-reduce (the H200 runs had one GPU): nccl-tests' all_reduce_perf on 8 x H100 SXM reaches a bus
# bandwidth of 460-480 GB/s on large messages (published reference figures); 450 GB/s is taken, and 10 us for
# an NCCL all-reduce's fixed latency on NVLink (small messages). A measured TP profile replaces both.
H200_NVLINK = AllReduce(0.010, 450e9 / 1e3, "assumed, not measured: NVLink 4 through NVSwitch, a bus bandwidth of "
                        "450 GB/s (nccl-tests all_reduce_perf on 8 x H100 SXM: 460-480 GB/s on large messages, "
                        "published) and a 10 us fixed latency per all-reduce")
DG_REDUCES_PER_LAYER = 3  # engine.models.diffusion_gemma.shard: after attention, after the dense MLP, after the experts


def tp_shape(shape: Shape, world: int, reduces_per_layer: int = DG_REDUCES_PER_LAYER) -> Shape:
    """One rank's share of ``shape`` under ``world``-way tensor parallelism (module doc): query heads, the dense
    MLP's and the experts' columns divided; K/V heads divided, or one per rank where there are fewer K/V heads
    than ranks; router, embeddings, self-conditioning and LM head whole; each layer launches its all-reduces too.
    A ValueError names what ``world`` does not divide."""
    if world < 1:
        raise ValueError(f"TP degree must be at least 1, got {world}")
    if world == 1:
        return shape
    for name, value in (("num_attention_heads", shape.attention[0].heads), ("intermediate_size", shape.intermediate),
                        ("moe_intermediate_size", shape.moe_intermediate)):
        if value % world:
            raise ValueError(f"TP degree {world} does not divide {name} = {value}")
    attention = []
    for a in shape.attention:
        if a.kv_heads >= world and a.kv_heads % world:
            raise ValueError(f"TP degree {world} does not divide num_key_value_heads = {a.kv_heads}")
        if a.kv_heads < world and world % a.kv_heads:
            raise ValueError(f"TP degree {world} is not a multiple of num_key_value_heads = {a.kv_heads}")
        attention.append(replace(a, heads=a.heads // world, kv_heads=max(a.kv_heads // world, 1)))
    return replace(shape, name=f"{shape.name}-tp{world}-rank", attention=tuple(attention),
                   intermediate=shape.intermediate // world, moe_intermediate=shape.moe_intermediate // world,
                   kernels_per_layer=shape.kernels_per_layer + reduces_per_layer)


# ---------------------------------------------------------------- the model


@dataclass(frozen=True)
class Rates:
    """The device's rates as a measured profile's fitted model shows them (see the module doc), and the host's
    time to launch one kernel of an eager forward (``dispatch_ms_per_kernel``, from ``calibrate_dispatch``)."""

    read_ms_per_param: float  # the weights' read: ms per bf16 parameter
    product_ms_per_param: float  # the products: ms per (token x parameter)
    pair_ms_per_unit: float  # attention: ms per (pair x layer x query head x head size)
    forward_ms: float
    step_ms: float
    decode_ms: float
    token_ms_per_unit: float  # ms per (token x layer x hidden)
    graph_tokens: float
    dispatch_ms_per_kernel: float = 0.0

    @property
    def read_bytes_per_ms(self) -> float:
        return BF16_BYTES / self.read_ms_per_param


def source_rates(profile: LatencyProfile, shape: Shape, kind: str = "cached") -> Rates:
    """The rates of ``profile`` (measured on ``shape``; ``kind``: the kind its shared terms were fitted on)."""
    m = profile.model
    if m.mode != "fit":
        raise ValueError(f"profile {profile.name} has no fitted model (too few measured token counts)")
    params = shape.dense_params(kind) + shape.active_expert_params
    read = shape.dense_params(kind) + shape.expert_params
    return Rates(read_ms_per_param=m.product_ms * m.ridge_tokens / read, product_ms_per_param=m.product_ms / params,
                 pair_ms_per_unit=m.pair_ms / sum(a.unit for a in shape.attention), forward_ms=m.forward_ms,
                 step_ms=m.step_ms, decode_ms=m.decode_ms, token_ms_per_unit=m.token_ms / (shape.layers * shape.hidden),
                 graph_tokens=m.graph_tokens)


@dataclass(frozen=True)
class ModelledRounds:
    """Round time of ``shape`` at ``rates`` (module doc): ``terms`` per forward, ``forward_ms`` their sum."""

    shape: Shape
    rates: Rates
    moe_efficiency: float = 1.0
    vocab_passes: float = 12.0
    tp: int = 1  # ranks: ``shape`` is one rank's (``tp_shape``), each layer all-reduces ``reduces_per_layer`` times
    all_reduce: AllReduce | None = None
    reduces_per_layer: int = DG_REDUCES_PER_LAYER

    def terms(self, kind: str, steps: float, query: float, context: float) -> dict[str, float]:
        """The forward's terms: ``launch-bound`` is what the host's launches of an eager forward take beyond
        the device's work (the device waits for them), 0 where the work hides them."""
        s, r = self.shape, self.rates
        tokens = steps * query
        if tokens <= 0:
            return {}
        dense = s.dense_params(kind)
        out = {"forward": r.forward_ms,
               "steps": (r.step_ms + (r.decode_ms if kind != "prefill" else 0.0)) * steps,
               "dense products": max(r.read_ms_per_param * dense, r.product_ms_per_param * dense * tokens)}
        if s.experts:
            read = r.read_ms_per_param * s.expert_params * s.touched_experts(tokens)
            flops = r.product_ms_per_param * s.active_expert_params * tokens * self.moe_efficiency
            out["experts"] = max(read, flops)
        out["tokens"] = r.token_ms_per_unit * s.layers * s.hidden * tokens
        if kind in s.logits_kinds:
            out["logits"] = self.vocab_passes * s.vocab * FP32_BYTES * tokens / r.read_bytes_per_ms
        attn = 0.0
        for a in s.attention:
            keys = max(context, 0.0) + query
            if a.window is not None:
                keys = min(keys, float(a.window))
            attn += r.pair_ms_per_unit * a.unit * tokens * keys
        out["attention"] = attn
        if self.tp > 1:
            if self.all_reduce is None:
                raise ValueError("a TP model needs its all-reduce's figures (all_reduce)")
            nbytes = tokens * s.hidden * BF16_BYTES
            out["all-reduce"] = self.reduces_per_layer * s.layers * self.all_reduce.ms(nbytes, self.tp)
        eager = tokens > r.graph_tokens if s.cuda_graphs else True
        work = sum(v for k, v in out.items() if k not in ("forward", "steps"))
        launches = r.dispatch_ms_per_kernel * s.kernels_per_layer * s.layers if eager else 0.0
        out["launch-bound"] = max(launches - work, 0.0)
        return out

    def forward_ms(self, kind: str, steps: float, query: float, context: float) -> float:
        return sum(self.terms(kind, steps, query, context).values())


# ---------------------------------------------------------------- the profile

SOURCE = "h200-llada8b-measured"
CALIBRATION = "h200-llada2mini-measured"
NAME = "h200-diffusiongemma-26b-a4b-modelled"
COMMAND = "python scripts/model_profile.py"
REF_CONTEXT = 512  # a denoising step's cache at the reference shape: a prompt and a canvas or so
DENOISE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # canvases per round
PREFILL_BATCHES = (1, 2, 4, 8, 16, 32)
PREFILL_LENGTHS = (16, 64, 256, 512)  # prompt tokens per encoder pass
DENOISE_CONTEXTS = (0, 768)  # other caches, within the sliding window (keys <= 1024): the attention's share


def file_hash(name: str) -> str:
    from engine.latency_profile import PROFILES_DIR

    return hashlib.sha256((PROFILES_DIR / f"{name}.json").read_bytes()).hexdigest()[:16]


def calibrate_dispatch(rates: Rates, calibration: LatencyProfile, shape: Shape) -> tuple[Rates, dict]:
    """The host's time per kernel launch of an eager forward, fitted (least squares in relative error, over a
    0.1 us grid) to a measured profile's eager rounds (above its CUDA-graph limit: same engine, same device),
    everything else from ``rates``; and every measured point of that profile against the model."""
    pts = [p for p in calibration.points if p.kind in ("denoise", "cached")]
    eager = [p for p in pts if p.tokens > rates.graph_tokens]
    if not eager:
        raise ValueError(f"calibration profile {calibration.name} has no rounds above the CUDA-graph limit")

    def errors(d: float, points) -> list[float]:
        m = ModelledRounds(shape, replace(rates, dispatch_ms_per_kernel=d), vocab_passes=0.0)
        return [m.forward_ms(p.kind, p.steps, p.query, p.context) / p.ms - 1.0 for p in points]

    best = min((i * 1e-4 for i in range(0, 401)), key=lambda d: sum(x * x for x in errors(d, eager)))
    rows = [{"tokens": p.tokens, "steps": p.steps, "eager": p.tokens > rates.graph_tokens, "measured_ms": p.ms,
             "modelled_ms": round(p.ms * (1 + e), 3), "error": round(e, 3)} for p, e in zip(pts, errors(best, pts))]
    return replace(rates, dispatch_ms_per_kernel=best), {
        "profile": calibration.name, "sha256_16": file_hash(calibration.name), "commit": calibration.meta.get("commit"),
        "shape": shape.name, "dispatch_us_per_kernel": round(best * 1e3, 2), "points": rows}


def model_profile(source: str = SOURCE, calibration: str | None = CALIBRATION, text: dict | None = None,
                  vocab_passes: float = 12.0, tp: int = 1, all_reduce: AllReduce = H200_NVLINK
                  ) -> tuple[LatencyProfile, ModelledRounds]:
    """The modelled DiffusionGemma-26B-A4B profile (module doc) and the model it samples. ``calibration``:
    the measured run whose eager rounds fit the host's time per kernel launch (None: 0, launches free).
    ``tp`` > 1: a TP-``tp`` instance's (``NAME-tp<tp>``): one rank's shard at the same rates, with
    ``all_reduce``'s figures for its all-reduces (module doc)."""
    text = dict(DG_26B_A4B_TEXT if text is None else text)
    src = load_profile(source)
    llada = preset_shape(LLADA_8B, "llada-8b-shape", KERNELS_PER_LAYER["llada-8b-shape"])
    rates = source_rates(src, llada)
    cal = None
    if calibration:
        mini = preset_shape(LLADA2_MINI, "llada2-mini-shape", KERNELS_PER_LAYER["llada2-mini-shape"])
        rates, cal = calibrate_dispatch(rates, load_profile(calibration), mini)
    whole = gemma_shape(text, "diffusiongemma-26b-a4b", KERNELS_PER_LAYER["diffusiongemma"])
    shape = tp_shape(whole, tp)
    model = ModelledRounds(shape, rates, 1.0, vocab_passes, tp, all_reduce if tp > 1 else None)
    points = []
    for n in DENOISE_BATCHES:
        for ctx in (REF_CONTEXT, *DENOISE_CONTEXTS):
            points.append(ProfilePoint("denoise", n, DG_CANVAS, ctx, round(model.forward_ms("denoise", n, DG_CANVAS,
                                                                                                 ctx), 3)))
    for q in PREFILL_LENGTHS:
        for n in PREFILL_BATCHES:
            points.append(ProfilePoint("prefill", n, q, 0, round(model.forward_ms("prefill", n, q, 0), 3)))
    curves: dict[str, list[tuple[float, float]]] = {}
    for kind, ctx, q in (("denoise", REF_CONTEXT, None), ("prefill", 0, PREFILL_LENGTHS[-1])):
        curves[kind] = [(p.tokens, p.ms) for p in points if p.kind == kind and p.context == ctx
                        and (q is None or p.query == q)]
    # the full layers' attention grows with every key: the profile's pair term; the sliding layers' (at most a
    # window of keys) is in the points, so in the fitted per-token terms
    pair_ms = sum(rates.pair_ms_per_unit * a.unit for a in shape.attention if a.window is None)
    meta = {
        "modelled": True,
        "model": "google/diffusiongemma-26B-A4B-it",
        "device": "NVIDIA H200 (modelled: no GPU has run this shape)",
        "dtype": "bfloat16",
        "replace_with": "a GPU run: `remask profile` of the checkpoint on an H200 (its prefill and denoise "
                        "rounds), saved over this file; until then every number here is modelled",
        "method": "the source profile's fitted RoundModel as device rates (weight read, products, attention "
                  "pairs, fixed per forward, per step), priced on the target's architecture "
                  "(engine/profile_model.py): products per part bounded below by their weights' read, the "
                  "routed experts' read by the experts a forward's tokens touch (uniform routing: "
                  "E(1-(1-k/E)^T) per layer), their FLOPs by the top-k active experts; attention per layer "
                  "type (sliding layers' keys capped at the window); [tokens, vocab] float32 logit passes on a "
                  "denoising step; no CUDA graphs, so a forward takes at least its kernels' launches (kernels "
                  "counted in this engine's code, the host's time per launch fitted to the calibration run's "
                  "eager rounds). Points sampled at the shapes a profile run measures; the RoundModel "
                  "refitted to them (fit_error_vs_model).",
        "command": COMMAND,
        "source": {"profile": source, "sha256_16": file_hash(source), "commit": src.meta.get("commit"),
                   "shape": asdict(llada) | {"total_params": llada.total_params},
                   "rates": asdict(rates)},
        "calibration": cal,
        "moe_efficiency": model.moe_efficiency,
        "vocab_passes": vocab_passes,
        "architecture": {"text_config": text, "canvas_length": DG_CANVAS, "shape": asdict(whole),
                         "total_params": whole.total_params, "active_params": whole.active_params,
                         "expert_params": whole.expert_params, "active_expert_params": whole.active_expert_params,
                         "dense_params": {k: whole.dense_params(k) for k in ("prefill", "denoise")},
                         "weight_bytes": BF16_BYTES * (whole.total_params + whole.hidden * whole.vocab)},
        "kernels_per_layer": dict(KERNELS_PER_LAYER),
        "attention": "attn_ms_per_pair is the full layers' (they attend to every key); the sliding layers' "
                     f"attention (at most {shape.attention[0].window} keys) is in the points, so in the fitted "
                     "per-token terms: context_error gives the profile against the model by cache length",
        "cuda_graphs": False,
        "block_size": DG_CANVAS,
        "batch_sizes": list(DENOISE_BATCHES),
        "prompt_lens": list(PREFILL_LENGTHS),
        "points": "modelled rounds: denoise = canvases of 256 tokens over a cache of "
                  f"{REF_CONTEXT} (ref_context), {', '.join(map(str, DENOISE_CONTEXTS))} tokens; prefill = "
                  "prompts of " + ", ".join(map(str, PREFILL_LENGTHS)) + " tokens encoded from an empty cache",
    }
    if tp > 1:
        meta.update(tp_meta(model, whole))
    prof = LatencyProfile(NAME if tp == 1 else f"{NAME}-tp{tp}", curves, float(REF_CONTEXT), pair_ms, 0.0, meta,
                          points)
    meta["fit_error_vs_model"] = fit_check(prof, model)
    meta["context_error"] = context_error(prof, model)
    if tp == 1:  # the published figure is one GPU's
        meta["published_check"] = published_check(prof, model)
    return prof, model


def tp_meta(model: ModelledRounds, whole: Shape) -> dict:
    """What a TP profile's meta adds: the degree, how a rank's rounds are priced, its shard, the all-reduce's
    figures and where they come from, and its rounds against TP-1's (the same model on the whole shape)."""
    one = ModelledRounds(whole, model.rates, model.moe_efficiency, model.vocab_passes)
    s = model.shape
    vs = {}
    for kind, n, q, c in (("denoise", 1, DG_CANVAS, REF_CONTEXT), ("denoise", 16, DG_CANVAS, REF_CONTEXT),
                          ("denoise", 64, DG_CANVAS, REF_CONTEXT), ("prefill", 1, 512, 0), ("prefill", 16, 512, 0)):
        terms = model.terms(kind, n, q, c)
        vs[f"{kind} {n} x {q}"] = {"tp1_ms": round(one.forward_ms(kind, n, q, c), 3),
                                   "ms": round(sum(terms.values()), 3),
                                   "all_reduce_ms": round(terms.get("all-reduce", 0.0), 3),
                                   "launch_bound_ms": round(terms.get("launch-bound", 0.0), 3)}
    return {"tp": model.tp,
            "tensor_parallel": {
                "method": "one rank's shard priced at the source's device rates (query heads, the dense MLP's and "
                          "each expert's columns divided by the degree; K/V heads divided, or one per rank where "
                          "fewer; router, embeddings, self-conditioning and LM head whole, as "
                          "engine.models.diffusion_gemma.shard splits a checkpoint), plus "
                          f"{model.reduces_per_layer} all-reduces per layer of the [tokens, hidden] bf16 activation "
                          "and their launches (one kernel each)",
                "rank_shape": asdict(s), "rank_weight_bytes": BF16_BYTES * (s.total_params + s.hidden * s.vocab),
                "reduces_per_layer": model.reduces_per_layer, "all_reduce": asdict(model.all_reduce),
                "vs_tp1": vs},
            "replace_with": f"a GPU run on {model.tp} H200s (`remask profile --tp {model.tp}` of the checkpoint, "
                            "saved over this file); until then every number here is modelled, the all-reduce's "
                            "figures assumed"}


def fit_check(prof: LatencyProfile, model: ModelledRounds) -> dict:
    """The profile's fitted RoundModel against the architectural model it was sampled from: the largest
    relative error at its points and at shapes between them."""
    def err(kind, n, q, c):
        want = model.forward_ms(kind, n, q, c)
        return abs(prof.forward_ms(kind, n, q, c) - want) / want

    at_points = max(err(p.kind, p.steps, p.query, p.context) for p in prof.points)
    between = max([err("denoise", n, DG_CANVAS, c) for n in (3, 6, 12, 24, 48) for c in (128, 768)]
                  + [err("prefill", n, q, 0) for n in (2, 8, 24) for q in (32, 128, 256)])
    return {"at_points": round(at_points, 4), "between_points": round(between, 4)}


def context_error(prof: LatencyProfile, model: ModelledRounds) -> dict[str, float]:
    """The profile's largest relative error against the model over 1-64 canvases, by the canvases' cache."""
    return {f"cache {c}": round(max(abs(prof.forward_ms("denoise", n, DG_CANVAS, c)
                                        / model.forward_ms("denoise", n, DG_CANVAS, c) - 1)
                                    for n in DENOISE_BATCHES), 3) for c in (0, 512, 1024, 2048, 4096, 8192)}


def profile_json(prof: LatencyProfile) -> str:
    return json.dumps(prof.to_dict(), indent=1) + "\n"


def rounds_summary(prof: LatencyProfile) -> list[dict]:
    """A few rounds priced by the profile (what the docs quote)."""
    rows = []
    for n in (1, 4, 16, 64):
        ms = prof.forward_ms("denoise", n, DG_CANVAS, REF_CONTEXT)
        rows.append({"kind": "denoise", "canvases": n, "ms": round(ms, 2), "ms_per_canvas": round(ms / n, 2)})
    for q in (16, 512, 4096):
        rows.append({"kind": "prefill", "tokens": q, "ms": round(prof.forward_ms("prefill", 1, q, 0), 2)})
    return rows


# Published (vLLM's DiffusionGemma launch figures, as reported): one request on an H200, FP8 weights, CUDA
# graphs: 1,288 output tokens/s; about 15-20 tokens kept per denoising pass at the default bound 0.1
# (the Unsloth model card, as reported), i.e. 256 / 17.5 = 14.6 steps per 256-token canvas.
PUBLISHED_TOKENS_PER_S = 1288.0
PUBLISHED_STEPS_PER_CANVAS = 256 / 17.5


def published_check(prof: LatencyProfile, model: ModelledRounds | None = None) -> dict:
    """One request's output tokens/s by the profile (a canvas of ``PUBLISHED_STEPS_PER_CANVAS`` denoising
    steps over a 512-token cache, then its encoder pass), against the published figure; with ``model``, also
    the architectural model with the weight reads halved (FP8 weights) and no launch term (CUDA graphs), the
    published run's setting."""
    steps = PUBLISHED_STEPS_PER_CANVAS
    canvas_ms = (steps * prof.forward_ms("denoise", 1, DG_CANVAS, REF_CONTEXT)
                 + prof.forward_ms("prefill", 1, DG_CANVAS, 0))
    out = {"published_tokens_per_s": PUBLISHED_TOKENS_PER_S, "steps_per_canvas": round(steps, 2),
           "modelled_bf16_tokens_per_s": round(DG_CANVAS / canvas_ms * 1000, 1),
           "ratio_bf16": round(DG_CANVAS / canvas_ms * 1000 / PUBLISHED_TOKENS_PER_S, 3)}
    if model is not None:
        def fp8(kind, q, c):
            t = model.terms(kind, 1, q, c)
            s, r = model.shape, model.rates
            read_d = r.read_ms_per_param * s.dense_params(kind)
            read_e = r.read_ms_per_param * s.expert_params * s.touched_experts(q)
            t["dense products"] = max(read_d / 2, t["dense products"] if t["dense products"] > read_d else 0.0)
            if "experts" in t:
                t["experts"] = max(read_e / 2, t["experts"] if t["experts"] > read_e else 0.0)
            t["launch-bound"] = 0.0
            return sum(t.values())
        ms = steps * fp8("denoise", DG_CANVAS, REF_CONTEXT) + fp8("prefill", DG_CANVAS, 0)
        out["modelled_fp8_graphs_tokens_per_s"] = round(DG_CANVAS / ms * 1000, 1)
        out["ratio_fp8_graphs"] = round(DG_CANVAS / ms * 1000 / PUBLISHED_TOKENS_PER_S, 3)
    return out

"""vLLM's CPU attention backend, serving WUSH-KV when the model folder holds a wushkv side file (vLLM 0.32.0).

:func:`wushkv_vllm.register` puts :class:`WushKVCPUBackend` in place of ``CPU_ATTN`` (vLLM's own override,
``register_backend``; the CPU platform always asks for ``CPU_ATTN``). For a folder without a side file every method
is vLLM's. With one:

* ``customize_spec`` gives vLLM the size of one (token, KV head) cell (:class:`wushkv_vllm.paged.SlotCodec`), so vLLM
  sizes, allocates and counts its paged cache in quantized cells (the log's ``KV cache size: N tokens`` is theirs);
* ``do_kv_cache_update`` transforms the new keys after RoPE, ``K' = (K − key_mean)·key`` per KV head, quantizes keys
  and values per token and writes their cells at vLLM's slots (one call of wushkv's fused store,
  :meth:`wushkv_vllm.paged.SlotCodec.store`), and hands the transformed keys to the layer's forward of the same step;
  key tiles (``+ktiles``) are written by the forward when their last token is stored, from the copies of their tokens
  (:func:`wushkv_vllm.paged.store_tiles`); keys centered on their rotating mean (``+rmean``) are stored by the forward,
  which knows the tokens' positions (:class:`wushkv_vllm.paged.RopeMean`);
* ``forward`` attends: queries ``Q' = Q·query`` (``Q'K'ᵀ = QKᵀ`` up to a per-query constant, which softmax ignores)
  over the request's context read from its cells through the block table, a query at position p reading a token in
  full precision while it is in the windows of a sequence of p + 1 tokens (copies from
  :class:`wushkv_vllm.paged.Windows`, the step's own tokens as computed), from its codes otherwise: what p would read
  had the sequence been decoded token by token, wushkv's own cache's rule, so a prefill chunk, a prompt's
  log-probabilities and a decode step all see the quantized cache.

Values need nothing at run time: T_V is folded into ``v_proj``/``o_proj`` by ``wushkv export-model``.
The update and forward are :class:`ServedImpl`'s, which the CUDA backends share (:mod:`wushkv_vllm.cuda`).
The decode rows of a step (one query each) go through one call of wushkv's fused kernel for the whole batch
(:func:`wushkv_vllm.paged.decode_batch`: each request's context read through its block table, window tokens from
their copies, the rest from the codes); prefill chunks decode their context and attend in plain torch
(:func:`wushkv_vllm.paged.attend`). Both follow the same rule, under chunked prefill, prefix caching, preemption and
mixed batches.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from dataclasses import replace

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from wushkv.triton_kernels import to_device

from .paged import RopeMean, SlotCodec, Windows, attend, decode_batch, decode_context, step_positions, store_tiles
from .served import Served, UnsupportedFolder, has_side_file, load_served

logger = init_logger("vllm.wushkv")  # under vLLM's logger: shown with its own lines
# What each engine of this process serves, by its vLLM config and model folder: read once per engine (served_model()
# is asked once per attention layer). Per engine, not per process: one Python process may build several (``vllm.LLM``
# twice with VLLM_ENABLE_V1_MULTIPROCESSING=0), each with its own dtype, log lines and decode path. Weak: a dropped
# engine's goes.
_SERVING: list[tuple[weakref.ref, str, Served | None]] = []
# What the last model built in this process serves, set when its attention layers are built (vLLM's config is current
# then): vLLM asks the backend for its cell size later, outside that context (Worker.get_kv_cache_spec).
_BUILT: list[Served | None] = [None]


def served_model(vllm_config=None) -> Served | None:
    """What the model of ``vllm_config`` (default: vLLM's current config, else the model this process built last)
    serves (None: a folder without a side file, stock vLLM)."""
    cfg = vllm_config
    if cfg is None:
        try:
            cfg = get_current_vllm_config()
        except Exception:  # no current config (vLLM raises): the model this process built
            cfg = None
    mc = None if cfg is None else cfg.model_config
    if mc is None:
        return _BUILT[-1]
    for r, folder, served in _SERVING:
        if r() is cfg and folder == mc.model:
            return served
    served = _load(mc)
    _SERVING[:] = [e for e in _SERVING if e[0]() is not None] + [(weakref.ref(cfg), mc.model, served)]  # dropped engines go
    return served


def _load(mc) -> Served | None:
    folder = mc.model
    if not has_side_file(folder):
        return None
    hf = mc.hf_text_config
    served = load_served(folder, num_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size())
    n_attn = len(served.meta.get("attention_layers") or ())
    if n_attn and getattr(hf, "num_hidden_layers", n_attn) < max(served.meta["attention_layers"]) + 1:
        raise UnsupportedFolder(f"{folder}: the side file names decoder layer {max(served.meta['attention_layers'])}, "
                                f"the model has {hf.num_hidden_layers} layers; export the folder again")
    q, w = served.cfg, served.cfg.windows
    tail = (f"last {w.S_keep}" if served.flush == 1 else
            f"last {w.S_keep} to {w.S_keep + served.flush - 1} (key tiles of {served.flush}, written whole)")
    logger.info("wushkv: serving %s (K%sV%s %s) from %s: %d-byte cells per token and KV head (%d in %s), windows: "
                "first %d and %s tokens in full precision", served.meta["method"], q.k_bits, q.v_bits, q.quantizer,
                folder, served.slot_bytes(mc.dtype.itemsize), 2 * served.head_dim * mc.dtype.itemsize, mc.dtype, w.S_sink, tail)
    return served


def _say_decode_path(fused: bool, st: "_LayerState", device: torch.device) -> None:
    """Once per engine (its :class:`Served`): which path decode steps take (the fused kernel, or the general one and why)."""
    if "decode path" in st.served.said:
        return
    st.served.said.add("decode path")
    cpu = device.type == "cpu"
    if fused:
        logger.info("wushkv: decode steps read the paged cells through the fused kernel (%s)",
                    "wushkv._ext.paged_decode" if cpu else "wushkv.triton_kernels.decode")
        return
    from wushkv import _ext

    if not cpu:
        why = ("the Triton decode does not take these cells (triton missing, a codec or head_dim it does not take, a "
               "metadata field at an odd byte offset, or +rmean below head_dim 32)")
    elif st.codec.sides() is None:
        why = "the cells are not per-token 1/2/4/8-bit codes"
    else:
        why = f"the CPU kernels did not build: {_ext.BUILD_ERROR or 'WUSHKV_NO_EXT is set'}"
    logger.warning("wushkv: decode steps take the general path (decode the context, then attend; slower): %s", why)


class WushKVCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN``, with WUSH-KV's cells for a served folder (module docstring)."""

    @classmethod
    def customize_spec(cls, spec):
        served = served_model()
        if served is None or spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=served.slot_bytes(spec.dtype.itemsize))

    @staticmethod
    def get_impl_cls():
        return WushKVCPUImpl


class _LayerState:
    """One attention layer's transforms, cell codec and windows, for this rank's KV heads."""

    def __init__(self, served: Served, layer_name: str, num_kv_heads: int, block_size: int, max_num_seqs: int,
                 dtype: torch.dtype, device: torch.device | None = None):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.served = served
        self.l = served.attention_layer(layer_name)
        heads = served.heads(num_kv_heads, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        t = served.layer(self.l, heads)

        def dev(x):  # the transforms on the cache's device; the rotating mean stays on the host (RopeMean.center)
            return None if x is None else x.to(device)

        self.key, self.query, self.key_mean = dev(t["key"]), dev(t["query"]), dev(t["key_mean"])
        # +rmean: the codes hold keys centered on their rotating mean, which needs positions: stored by the forward
        self.rope_mean = (RopeMean(t["key_mean_pre_rope"], t["key"], t["rope_inv_freq"], t["rope_scaling"])
                          if t["key_mean_pre_rope"] is not None else None)
        self.codec = SlotCodec(served.cfg, served.head_dim, dev(t["key_feedback"]), dev(t["value_feedback"]),
                               align=dtype.itemsize)
        if self.codec.tile and block_size % self.codec.tile:
            raise UnsupportedFolder(f"key tiles of {self.codec.tile} tokens are written into vLLM's blocks whole; the block size "
                                    f"{block_size} is not a multiple of it (serve with block_size={self.codec.tile})")
        # copies in the served dtype: what wushkv's cache keeps of its windows too (the model's dtype); on CPU stored
        # head-major, which the C++ decode streams (a GPU's Triton decode reads either layout: left as it was tested)
        win = Windows(block_size, num_kv_heads, served.head_dim, served.sink, served.recent, capacity=0, dtype=dtype,
                      flush=served.flush, max_open=4 * max_num_seqs, device=device, max_hits=8 * max_num_seqs,
                      head_major=torch.device(device if device is not None else "cpu").type == "cpu")
        win.capacity = 2 * max_num_seqs * win.pages_per_sequence()
        win.max_sink_pages = 4 * max_num_seqs * -(-win.sink // win.unit)
        self.windows = win
        self.missing, self.warned = 0, False  # window positions read from codes for want of a copy
        self.unwritten = self.unwritten_said = 0  # completed key tiles left as they were for want of a copy (store_tiles)
        self.stashed: torch.Tensor | None = None  # the step's transformed keys, from its update to its forward

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """K' = (K − key_mean)·key per KV head: (T, H, d) -> float32. On CPU one call of the C++ ``head_transform``,
        each token on its own: a key's bits, and so its codes, do not depend on the tokens transformed with it (a
        decode step's store and a recompute's prefill write the same bytes; torch's ``bmm`` changes its kernel, and
        its last bits, with T). Elsewhere torch."""
        ext = _transform_kernels(k)
        if ext is not None:
            return ext.head_transform(k, _EMPTY if self.key_mean is None else self.key_mean, self.key)
        k = k.float()
        if self.key_mean is not None:
            k = k - self.key_mean
        # one batched product over the heads, (H, T, d)·(H, d, d): einsum's planning cost more than the product at a
        # decode step's few tokens (24 µs against 12 a layer)
        return torch.bmm(k.transpose(0, 1), self.key).transpose(0, 1)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Q' = Q·query for the query heads of each KV head's group: (T, Hq, d) -> float32 (as :meth:`keys`: one C++
        call on CPU, where torch took six operations)."""
        ext = _transform_kernels(q)
        if ext is not None:
            return ext.head_transform(q, _EMPTY, self.query)
        T, Hq, d = q.shape
        H = self.query.shape[0]
        qg = q.float().reshape(T, H, Hq // H, d).transpose(0, 1).reshape(H, T * (Hq // H), d)  # (H, T·G, d)
        return torch.bmm(qg, self.query).view(H, T, Hq // H, d).transpose(0, 1).reshape(T, Hq, d)


_EMPTY = torch.empty(0)


def _transform_kernels(x: torch.Tensor):
    """The C++ kernels where they transform ``x`` (a CPU tensor with dense rows and the extension built), else None."""
    from wushkv._ext import kernels

    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.stride(-1) != 1:
        return None
    ext = kernels()
    return ext if ext is not None and hasattr(ext, "head_transform") else None


def host_batch(md) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """A step's batch as the windows' bookkeeping reads it, on the host: query start locations (R + 1) and sequence
    lengths (R) as ints, the slot mapping (T,) and the block table (R, ·). The CUDA backends' metadata carries these
    copies, made once a step for every layer (:class:`wushkv_vllm.cuda.WushKVMetadata`); on CPU they are the tensors."""
    host = getattr(md, "host", None)
    if host is not None:
        return host
    return md.query_start_loc.tolist(), md.seq_lens.tolist(), md.slot_mapping.cpu(), md.block_table.cpu()


_STEP_PLANS: "OrderedDict[int, tuple[object, dict]]" = OrderedDict()


def step_plan(md, batch: tuple) -> dict:
    """A dict shared by the layers that attend with the step's metadata ``md``: vLLM hands every layer of a KV cache
    group the same metadata object in a step and builds a new one each step, so what a decode works out from the
    batch alone (its rows, their indices on the device, the windows' parts: :func:`wushkv_vllm.paged.decode_batch`'s
    ``plan``) is worked out once a step instead of once a layer. ``batch``: the step's layout on the host (query
    start locations and sequence lengths); a metadata object seen with another is a new step's (a fresh dict). Holds
    ``md`` itself (its id cannot be reused while it is held); the last 8 are kept (a model's KV cache groups)."""
    hit = _STEP_PLANS.get(id(md))
    if hit is not None and hit[0] is md and hit[1]["batch"] == batch:
        _STEP_PLANS.move_to_end(id(md))
        return hit[1]
    plan: dict = {"batch": batch}
    _STEP_PLANS[id(md)] = (md, plan)
    while len(_STEP_PLANS) > 8:
        _STEP_PLANS.popitem(last=False)
    return plan


class ServedImpl:
    """WUSH-KV's key update and attention (module docstring), for a vLLM attention impl it precedes in the bases
    (``class X(ServedImpl, SomeAttentionImpl)``): with no side file every call is that impl's. The tensors of a step
    are on the cache's device; the windows' bookkeeping and the batch's layout (:func:`host_batch`) on the host."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served = served_model()
        _BUILT[-1] = self.served
        if self.served is not None:
            if self.alibi_slopes is not None or self.sinks is not None:
                raise UnsupportedFolder("the wushkv plugin serves models without ALiBi and without learned attention sinks")
            cfg = get_current_vllm_config()
            self._max_num_seqs, self._dtype = cfg.scheduler_config.max_num_seqs, cfg.model_config.dtype
        # the sliding window in tokens (−1: none): CPU_ATTN keeps it so, the CUDA impls as (window − 1, 0)
        w = self.sliding_window
        self._window = w if isinstance(w, int) else (w[0] + 1 if w[0] >= 0 else -1)
        self._state: _LayerState | None = None

    def _layer(self, layer, kv_cache: torch.Tensor) -> _LayerState:
        if self._state is None:
            self._state = _LayerState(self.served, layer.layer_name, self.num_kv_heads, kv_cache.shape[2], self._max_num_seqs,
                                      self._dtype, kv_cache.device)
        return self._state

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.served is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        st = self._layer(layer, kv_cache)
        n = slot_mapping.shape[0]
        k = st.keys(key[:n])
        # stored here on CPU; on a device by the forward, which has the step's slots on the host (the padding told
        # without a wait), as for +rmean, whose codes need the tokens' positions
        if st.rope_mean is None and kv_cache.device.type == "cpu":
            st.codec.store(kv_cache.view(torch.uint8), k, value[:n], slot_mapping)
        # this step's forward of the layer attends with the same transformed keys: handed over, not computed again
        # (taken by the next forward, so a step never sees another step's keys; vLLM runs a layer's update and then
        # its forward on the same key tensor)
        st.stashed = k

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if self.served is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the wushkv backend")
        if attn_metadata is None:  # warm-up
            if self._state is not None:
                self._state.stashed = None
            return output
        st = self._layer(layer, kv_cache)
        cache, dev = kv_cache.view(torch.uint8), kv_cache.device
        T = attn_metadata.num_actual_tokens
        k_new, st.stashed = st.stashed, None
        k_new = k_new[:T] if k_new is not None and k_new.shape[0] >= T else st.keys(key[:T])
        v_new = value[:T]  # as the model gave it: the windows' write converts it; float32 for prefill rows (below)
        starts, seq_lens, host_slots, host_tables = host_batch(attn_metadata)
        host_slots = host_slots[:T]
        rm = st.rope_mean
        # what the step's layers work out from the batch alone, once a step (step_plan): the rows with queries, their
        # (block ids, length) for the windows' trim, the copies a later prefix-cache hit would read (hit_marks), and
        # the step's positions (host) where a layer needs them: for +rmean, and to mark sink pages (only a step
        # holding a position below the sink)
        plan = step_plan(attn_metadata, (tuple(starts), tuple(seq_lens)))
        batch = plan.get(("batch", st.windows.sink))
        if batch is None:
            rows = [r for r in range(len(seq_lens)) if starts[r + 1] > starts[r]]
            in_sink = any(seq_lens[r] - (starts[r + 1] - starts[r]) < st.windows.sink for r in rows)
            seqs = [(host_tables[r], seq_lens[r]) for r in rows]
            marks = st.windows.hit_marks([(t, n, starts[r + 1] - starts[r]) for (t, n), r in zip(seqs, rows)])
            batch = plan[("batch", st.windows.sink)] = (rows, seqs, in_sink, {}, marks)
        rows, seqs, in_sink, positions, marks = batch
        pos = None
        if rm is not None or in_sink:
            pos = positions.get("host")
            if pos is None:
                pos = positions["host"] = step_positions(torch.tensor(starts), torch.tensor(seq_lens))
        if rm is not None:  # the codes of K' − c'_t
            pos_dev = positions.get(dev)
            if pos_dev is None:
                pos_dev = positions[dev] = to_device(pos, dev)
            st.codec.store(cache, k_new - rm.center(pos_dev), value[:T], attn_metadata.slot_mapping[:T], host_slots)
        elif dev.type != "cpu":  # the update left the store to the forward (there the padding is known on the host)
            st.codec.store(cache, k_new, value[:T], attn_metadata.slot_mapping[:T], host_slots)
        st.windows.write(k_new, v_new, host_slots, pos)
        if st.codec.tile:  # the key tiles this step completes: written from their tokens' copies, before anything reads them
            st.unwritten += store_tiles(st.codec, cache, st.windows, host_slots, rm, pos)
        q = st.queries(query[:T])
        tables = attn_metadata.block_table
        window = self._window
        # decode rows (one query) of the whole batch in one call of the fused kernel, straight from the codes; which
        # rows, their places and block tables on the device: once a step, for every layer (step_plan)
        if "dec" not in plan:
            dec = [r for r in rows if starts[r + 1] - starts[r] == 1]
            idx = torch.tensor(dec, dtype=torch.long)
            # the decode rows are the step's first tokens, in order (a step of decodes alone, and vLLM puts them
            # first): slices instead of indexed reads and writes, two operations fewer a layer
            first = [starts[r] for r in dec] == list(range(len(dec)))
            at = slice(0, len(dec)) if first else to_device(torch.tensor([starts[r] for r in dec], dtype=torch.long), dev)
            plan["dec"] = (dec, at,
                           tables[to_device(idx, dev)], torch.tensor([seq_lens[r] for r in dec], dtype=torch.long),
                           host_tables[idx])
        dec, at, dec_tables, dec_lens, dec_host = plan["dec"]
        if dec:
            out = decode_batch(st.codec, cache, dec_tables, dec_lens, q[at], st.windows, self.scale, window,
                               self.logits_soft_cap, rm, None if rm is None else query[at].float(), host_table=dec_host,
                               plan=plan)
            if out is not None:
                if isinstance(at, slice):
                    output[at].copy_(out)
                else:
                    output[at] = out.to(output.dtype)
                rows = [r for r in rows if starts[r + 1] - starts[r] != 1]
            _say_decode_path(out is not None, st, dev)
        if rows:
            v_new = v_new.float()
        for r in rows:  # prefill chunks (and every row where the kernel is not available): decode, then attend
            n, a, b = seq_lens[r], starts[r], starts[r + 1]
            ctx = n - (b - a)
            lo = max(0, ctx - window + 1) if window > 0 else 0  # the oldest position any of the step's queries reads
            kq, vq = decode_context(st.codec, cache, tables[r], n, lo)  # (H, n − lo, d), the step's tokens included
            if rm is not None:  # read from codes, a key is k̂ + c'_t (the copies, which hold K', replace it in the windows)
                kq += rm.center(torch.arange(lo, n, device=dev)).transpose(0, 1)
            kf, vf = torch.zeros_like(kq), torch.zeros_like(vq)
            known = torch.zeros(n - lo, dtype=torch.bool, device=dev)
            st.missing += st.windows.read(kf, vf, known, host_tables[r], lo, ctx, ctx)
            kf[:, ctx - lo:], vf[:, ctx - lo:], known[ctx - lo:] = k_new[a:b].transpose(0, 1), v_new[a:b].transpose(0, 1), True
            # positions on the host: attend works out each block's columns there (no wait for the device)
            out = attend(q[a:b], torch.arange(ctx, n), kq, vq, kf, vf, known, torch.arange(lo, n),
                         st.windows.sink, st.windows.recent, self.scale, window, self.logits_soft_cap, flush=st.windows.flush)
            output[a:b] = out.to(output.dtype)
        st.windows.remember(marks)
        st.windows.protect_and_trim(seqs)
        if st.missing and not st.warned:  # once per layer: quality below wushkv's cache, say so
            st.warned = True
            logger.warning("wushkv: layer %d read %d window positions from their codes: their full-precision copies were "
                           "dropped past %d pages (raise max_num_seqs to keep more)", st.l, st.missing, st.windows.capacity)
        if st.unwritten > st.unwritten_said:  # a completed key tile without all its copies: left as it was
            st.unwritten_said = st.unwritten
            logger.warning("wushkv: layer %d: %d key tiles completed without the copies of all their tokens (%d open tiles let go "
                           "past %d); their key codes were not written", st.l, st.unwritten, st.windows.abandoned,
                           st.windows.max_open)
        return output


class WushKVCPUImpl(ServedImpl, CPUAttentionBackendImpl):
    """CPU attention over WUSH-KV cells (module docstring); stock ``CPU_ATTN`` for a folder without a side file."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.served is not None:
            _kernels_at_start()


def _kernels_at_start() -> None:
    """The C++ kernels built (or loaded from their cache) while the engine builds its model, once per process: left to
    the first request's first step, a new source version's build (about a minute) would stall that request and
    every request batched with it."""
    from wushkv import _ext

    if _ext.looked_up():
        return
    t0 = time.perf_counter()
    ext = _ext.kernels()
    seconds = time.perf_counter() - t0
    if ext is not None and seconds > 1:
        logger.info("wushkv: built the CPU kernels in %.0f s (once per source version and environment)", seconds)

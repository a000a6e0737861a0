"""Tiny random models built from configs in code (seconds on a CPU), shared by the tests."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# The suite never reaches the network: where a model or data file is not found here, the hub's fallback fails at once
# instead of waiting out connections that a sandbox or a CI machine cannot make (tens of seconds a test).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The Triton kernels (wushkv.triton_kernels) run on CPU tensors under Triton's interpreter, which triton reads once,
# when it is first imported (building a model imports it): set it before anything can, unless a CUDA device is here,
# where the same tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite in pytest-xdist workers (one a core on CI's two): each takes its share of the cores, and
# so do the processes it starts, instead of every worker's OpenMP threads spinning on every core (oversubscribed).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)


from xdist_groups import pytest_itemcollected  # noqa: E402,F401  (a hook: make test's workers, tests/xdist_groups.py)


# Every family the adapter supports (wushkv.models.FAMILIES), as a tiny random config: (config class, overrides of
# COMMON). Keys are the test names of the families (model_type, but "gemma3" for gemma3_text). A family added to
# the adapter without an entry here fails tests/test_families.py; an entry here runs through every check there.
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),  # every layer sliding (no layer_types)
    "qwen2": ("Qwen2Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", _MOE),
    "qwen3": ("Qwen3Config", {"use_sliding_window": False}),
    "qwen3_moe": ("Qwen3MoeConfig", _MOE),
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                                    "query_pre_attn_scalar": 32}),
    "granite": ("GraniteConfig", {"attention_multiplier": 0.1, "residual_multiplier": 0.5, "embedding_multiplier": 4.0, "logits_scaling": 2.0}),
    "olmo2": ("Olmo2Config", {}),
    "phi3": ("Phi3Config", {}),
    "gpt_oss": ("GptOssConfig", _MOE | {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                            "truncate": False, "original_max_position_embeddings": 128,
                                                            "rope_theta": 10000.0}}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0, 1]}),  # layer 1 without RoPE
    "lfm2": ("Lfm2Config", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                            "hidden_size": 128, "intermediate_size": 256}),
}


def tiny_config(family: str, **over):
    """A tiny config of ``family`` (a key of :data:`TINY_CONFIGS`) with GQA (2 query heads per KV head) and head_dim 32."""
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family not in TINY_CONFIGS:
        raise ValueError(family)
    cls, extra = TINY_CONFIGS[family]
    return getattr(transformers, cls)(**(common | extra | over))


def tiny_model(family: str, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # eager experts: the grouped-matmul MoE kernels take no float64, and the tests run float64 models
    model = AutoModelForCausalLM.from_config(tiny_config(family, **over), dtype=torch.float32, experts_implementation="eager")
    # Random init has tiny weights; scale the attention projections so attention is not uniform
    # and keys carry some anisotropy (a harder, more realistic test of the transforms).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")) and p.dim() == 2:
                p.mul_(4.0)
                p[:, :3].mul_(3.0)  # outlier input channels
            if "v_proj" in name and p.dim() == 2:
                p.mul_(4.0)
            if name.endswith("sinks"):  # learned sink logits large enough to take a visible share of attention
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    model.eval()
    model.config._name_or_path = f"tiny-{family}"
    return model


def left_padded(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (1, n_b) of token ids left-padded into one batch: (ids (B, L), attention_mask (B, L)), L = max n_b."""
    L = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - r.shape[1] :], mask[b, L - r.shape[1] :] = r[0], 1
    return ids, mask


@torch.no_grad()
def padded_prefill_then_decode(model, cache, ids: torch.Tensor, mask: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """Prefill the left-padded batch (ids, mask), then decode ``nxt`` (B, steps) one token per step, positions counted
    from each row's first real token: the logits of every step, (B, L + steps, vocab)."""
    B = ids.shape[0]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits]
    for t in range(nxt.shape[1]):
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        out.append(model(nxt[:, t : t + 1], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits)
    return torch.cat(out, 1)


@contextlib.contextmanager
def padded_decode_view(model, cfg, lengths, rmean: bool = False, seed: int = 5):
    """Layer 0's view of one decode step of a left-padded batch of random rows of ``lengths`` tokens, under random
    transforms (``rmean``: keys centered on a rotating mean measured on the first row): yields (view, query
    (B, 2·Hkv, 1, d) in transformed space, allowed (B, 1, 1, S) bool) with the transforms installed."""
    from wushkv.calibration import pre_rope_key_mean
    from wushkv.folding import apply_transforms
    from wushkv.models import describe
    from wushkv.transforms import build_transforms

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 96, (1, n), generator=g) for n in lengths]
    dev = next(model.parameters()).device
    ids, mask = (t.to(dev) for t in left_padded(rows))
    spec = describe(model)
    transforms = [build_transforms("random", spec.num_kv_heads, spec.head_dim, seed=l) for l in range(spec.num_layers)]
    if rmean:
        mus = pre_rope_key_mean(model, rows[0][:, :64].to(dev), show_progress=False)
        transforms = [t.replace(mu_K_rope=m.float()) for t, m in zip(transforms, mus)]
    with torch.no_grad(), apply_transforms(model, transforms, "random") as inst:
        cache = inst.cache(cfg, attention_mask=mask)
        model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache, use_cache=True)
        B, H, d = len(rows), spec.num_kv_heads, spec.head_dim
        k, v, q = (torch.randn(B, h, 1, d, generator=g).to(dev) for h in (H, H, 2 * H))
        view, _ = cache.layers[0].update(k, v)
        allowed = torch.cat([mask, mask.new_ones(B, 1)], 1).bool().view(B, 1, 1, -1)
        yield view, q, allowed


FAMILIES = ["llama", "qwen3", "gemma3"]  # the families the rest of the suite runs every check on
ALL_FAMILIES = list(TINY_CONFIGS)  # every supported family: tests/test_families.py


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


class CharTokenizer:
    """A byte-level stand-in for a HF tokenizer: ``tok(text, return_tensors="pt").input_ids``."""

    bos_token_id = 1

    def __init__(self, vocab_size: int = 96):
        self.vocab_size = vocab_size

    def decode(self, ids, skip_special_tokens=False) -> str:
        """Inverse for printable ASCII (ids of bytes 32..95+3 map back); other ids become '?'."""
        return "".join(chr(i - 3) if 35 <= i < self.vocab_size else "?" for i in torch.as_tensor(ids).flatten().tolist())

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [3 + (b % (self.vocab_size - 3)) for b in text.encode("utf-8")]

        class Out:
            pass

        o = Out()
        o.input_ids = torch.tensor([ids], dtype=torch.long)
        return o


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()


CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def hf_char_tokenizer():
    """A real ``PreTrainedTokenizerFast`` (saveable, loadable by AutoTokenizer): one token per printable
    ASCII character or newline, ids 4..99; 0 pad, 1 bos, 2 eos, 3 unk. Use with ``vocab_size=128``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TINY_CALIBRATION_TEXT = "The quick brown fox jumps over the lazy dog; 0123456789 pack my box with five dozen liquor jugs. " * 20


@pytest.fixture
def tiny_cal(tmp_path):
    """A factory of small real calibrations (3 × 64 characters) of a tiny model."""
    from wushkv.calibration import calibrate

    def make(model):
        p = tmp_path / "calib.txt"
        p.write_text(TINY_CALIBRATION_TEXT)
        return calibrate(model, CharTokenizer(), samples=3, seq_len=64, text_file=str(p), show_progress=False)

    return make


def require_kernels():
    """The fused CPU kernels, for a test of them: a skip only on a machine that cannot build them (no compiler or
    ninja, or WUSHKV_NO_EXT set); where a toolchain is present a failed build fails the test, with the build's error."""
    from wushkv import _ext

    ext = _ext.kernels()
    if ext is not None:
        return ext
    if _ext.can_build():
        pytest.fail(f"the fused CPU kernels failed to build although a toolchain is present {_ext.toolchain()}: {_ext.BUILD_ERROR}")
    pytest.skip(f"the fused CPU kernels cannot be built here (toolchain {_ext.toolchain()}, WUSHKV_NO_EXT={os.environ.get('WUSHKV_NO_EXT')!r})")


def centered_parts(cfg, pads=None, B=2, H=2, d=32, n_mid=300, start=7, seed=0, device="cpu"):
    """Parts whose middle keys are quantized centered on a rotating mean (+rmean), as the cache stores them, and the
    keys those codes stand for, built here from the codec's decode and the centers at each row's positions:
    (parts of keys, parts of values, keys (B, H, N, d), values (B, H, N, d)) on ``device``."""
    from wushkv.codecs import make_codec
    from wushkv.layer import KeyCenters, RotatingKeyMean

    g = torch.Generator().manual_seed(seed)
    T = (torch.linalg.qr(torch.randn(H, d, d, generator=g, dtype=torch.float64))[0] * 1.5).to(device)
    km = RotatingKeyMean(torch.randn(H, d, generator=g) * 6, T, (10000.0 ** (-torch.arange(d // 2) / (d / 2)), 1.25))
    pos = torch.arange(start, start + n_mid)[None] - (0 if pads is None else pads[:, None])
    cen = km.center(pos, torch.float32)  # (B', H, n, d); a padded row's padding at negative positions
    x = lambda n: (torch.randn(B, H, n, d, generator=g) * torch.linspace(0.2, 3, d)).to(device)
    kc, vc = make_codec(cfg, "key", d), make_codec(cfg, "value", d)
    mid_k = x(n_mid) + cen
    store = kc.encode(mid_k - cen)
    pk = [x(3), (kc, store, n_mid, KeyCenters(km, start, pads)), x(5)]
    pv = [x(3), (vc, vc.encode(x(n_mid)), n_mid), x(5)]
    keys = torch.cat([pk[0], kc.decode(store, n_mid) + cen, pk[2]], dim=2)
    values = torch.cat([pv[0], vc.decode(pv[1][1], n_mid), pv[2]], dim=2)
    return pk, pv, keys, values

"""The Qwen4-Exp MTP head: conversion of the checkpoint's ``mtp.*`` tensors into the ``mtp`` component, and one MTP
step (:class:`ninfer_qwen4exp.mtp.Qwen4ExpMTPHead`) against an fp32 reference (CPU, fp32, tiny random configs).

transformers has no Qwen4-Exp MTP, so the reference is written here from the description (sglang's
``qwen4_exp_mtp.py`` as summarised for the project): the input fusion in plain torch, then the MTP layer and its
stream reduction as transformers' own ``Qwen4ExpTextDecoderLayer`` and ``hyper_connection_mixer`` (a one-layer
``Qwen4ExpTextModel`` whose weights are the ``mtp.*`` tensors; a pre-hook on its layer replaces the repeated
embedding with the fused bank), then the target's LM head. The ``mtp.*`` tensors are that model's state dict under
the inferred checkpoint names, plus random fusion weights. Generation: transformers' current qwen4_exp (QSA layers),
as the rest of this package.
"""

from __future__ import annotations

import json

import pytest
import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry
from ninfer.storage.kv_pool import PagedKVCache, SidePool
from ninfer.testing import CHATML_SPECIALS, convert_checkpoint, write_byte_tokenizer
from ninfer_qwen3_5.mtp import mtp_step_context
from ninfer_qwen4exp.config import Qwen4ExpConfig
from ninfer_qwen4exp.mtp import Qwen4ExpMTPHead, mtp_indexer_pool, mtp_kv_layer
from ninfer_qwen4exp.parameters import mtp_parameter_specs
from support.models import randomize_weights

from .harness import CASES, build_hf

pytest.importorskip("transformers.models.qwen4_exp")


def _mtp_reference_model(name: str, seed: int):
    """A one-layer transformers Qwen4-Exp text model (one attention layer, no PLE): its layer and final mixer are the
    MTP's."""
    import transformers as tf

    cfg = tf.Qwen4ExpTextConfig(**dict(CASES[name], num_hidden_layers=1, layer_types=["full_attention"],
                                       ple_layer_ids=[]))
    model = tf.Qwen4ExpTextModel(cfg)
    randomize_weights(model, seed)
    return model.float().eval()


def _inject_mtp(folder, ref, seed: int, drop: str | None = None, bad: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    st = folder / "model.safetensors"
    tensors = load_file(st)
    H = ref.config.hidden_size
    nh = H * ref.config.hc_count
    g = torch.Generator().manual_seed(seed)
    own = {"mtp.fc_embedding.weight": torch.randn(H, H, generator=g) / H ** 0.5,
           "mtp.fc_hidden.weight": torch.randn(H, H, generator=g) / H ** 0.5,
           "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(H, generator=g),
           "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(nh, generator=g)}
    for k, v in ref.state_dict().items():
        if k.startswith(("layers.0.", "hyper_connection_mixer.")):
            own[f"mtp.{k}"] = v.detach().clone().contiguous()
    if drop:
        own.pop(drop)
    if bad:
        own[bad] = torch.zeros(3, 5)
    tensors.update(own)
    save_file(tensors, st, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    cfg["mtp_use_dedicated_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _checkpoint(tmp_path, name: str, **inject):
    hf = build_hf(name, seed=31)
    ref = _mtp_reference_model(name, seed=32)
    src = tmp_path / f"{name}-src"
    hf.save_pretrained(src)
    write_byte_tokenizer(src, specials=CHATML_SPECIALS, eos="<|im_end|>")
    _inject_mtp(src, ref, 33, **inject)
    return hf, ref, src


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = {}
    for name in ("sparse", "plain"):
        root = tmp_path_factory.mktemp(f"q4x-mtp-{name}")
        hf, ref, src = _checkpoint(root, name)
        artifact = convert_checkpoint(src, root / "model.ninfer")
        with ArtifactReader.open(artifact) as reader:
            text_cfg = reader.component("text").config
            mtp_cfg = dict(reader.component("mtp").config)
            spec = get_registry().architecture(text_cfg["architectures"][0])
            from ninfer.contracts.features import StartupFeatures

            weights = load_weights(reader, spec.parameter_specs(text_cfg, StartupFeatures()), "cpu")
            weights.update(load_weights(reader, mtp_parameter_specs(text_cfg, mtp_cfg), "cpu"))
        out[name] = (hf, ref, src, text_cfg, mtp_cfg, weights)
    return out


def _rms1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _reference_logits(hf, ref, src_tensors: dict, tokens_next: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[T, V]`` of MTP positions ``0..T-1`` (the description in the module docstring)."""
    return _reference(hf, ref, src_tensors, tokens_next, bank)[0]


def _reference(hf, ref, src_tensors: dict, tokens_next: torch.Tensor, bank: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, V], the MTP layer's output banks [T, n*H])`` of MTP positions ``0..T-1``."""
    c = ref.config
    n, H, eps = c.hc_count, c.hidden_size, c.rms_norm_eps
    e = _rms1p(hf.model.embed_tokens.weight[tokens_next], src_tensors["mtp.pre_fc_norm_embedding.weight"], eps)
    e = e @ src_tensors["mtp.fc_embedding.weight"].T
    g = _rms1p(bank, src_tensors["mtp.pre_fc_norm_hidden.weight"], eps)
    x = (g.view(-1, n, H) @ src_tensors["mtp.fc_hidden.weight"].T + e[:, None, :]).reshape(1, -1, n * H)

    def swap(module, args, kwargs):
        return (x, *args[1:]), kwargs

    seen = {}

    def keep(module, args):
        seen["bank"] = args[0][0].clone()

    handles = [ref.layers[0].register_forward_pre_hook(swap, with_kwargs=True),
               ref.hyper_connection_mixer.register_forward_pre_hook(keep)]
    try:
        with torch.no_grad():
            out = ref(inputs_embeds=torch.zeros(1, x.shape[1], H), use_cache=False).last_hidden_state[0]
    finally:
        for h in handles:
            h.remove()
    return out @ hf.lm_head.weight.T, seen["bank"]


def _head(text_cfg, mtp_cfg, weights):
    cfg = Qwen4ExpConfig.from_compact(text_cfg)
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    head = Qwen4ExpMTPHead(cfg, mtp_cfg, weights, weights["text/embed"], weights["text/lm_head"], ops,
                           torch.device("cpu"), torch.float32)
    kv = PagedKVCache([mtp_kv_layer(cfg)], num_pages=64, page_size=4, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, dtype=torch.float32, device=torch.device("cpu"),
                      side=[SidePool(mtp_indexer_pool(cfg), 1, cfg.indexer_width)])
    return cfg, head, kv


@pytest.mark.parametrize("name", ["sparse", "plain"])
def test_mtp_component_converts_with_the_inferred_names(world, name):
    _, _, _, text_cfg, mtp_cfg, weights = world[name]
    assert mtp_cfg == {"architectures": ["Qwen4ExpMTP"], "mtp_num_hidden_layers": 1,
                       "mtp_use_dedicated_embeddings": False}
    cfg = Qwen4ExpConfig.from_compact(text_cfg)
    H, nh = cfg.hidden_size, cfg.hc_width
    assert weights["mtp/fc_hidden"].shape == (H, H) and weights["mtp/pre_fc_norm_hidden"].shape == (nh,)
    assert "mtp/layers/0/attention/indexer_q" in weights and "mtp/mixer_hc/up" in weights


@pytest.mark.parametrize("name", ["sparse", "plain"])
def test_mtp_step_logits_match_the_reference_in_chunks_and_decode(world, name):
    """Positions 0..T-1 as two chunks then one decode row (the later calls read the K/V and indexer keys the
    earlier ones wrote) equal the reference run over all T positions at once; ``sparse`` keeps fewer QSA blocks than
    the context holds, so the selection is sparse there."""
    hf, ref, src, text_cfg, mtp_cfg, weights = world[name]
    from safetensors.torch import load_file

    src_tensors = load_file(src / "model.safetensors")
    cfg, head, kv = _head(text_cfg, mtp_cfg, weights)
    g = torch.Generator().manual_seed(5)
    T = 23
    tokens_next = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    bank = torch.randn(T, cfg.hc_width, generator=g)
    want = _reference_logits(hf, ref, src_tensors, tokens_next, bank)
    assert kv.ensure(0, T, write_from=0)
    got = []
    for start, length in ((0, 9), (9, 13)):
        ctx = mtp_step_context(kv, chunks=[(0, start, length)], device=torch.device("cpu"))
        got.append(head.forward(tokens_next[start:start + length], bank[start:start + length], ctx, None).logits)
    ctx = mtp_step_context(kv, decode=[(0, T - 1)], device=torch.device("cpu"))
    got.append(head.forward(tokens_next[T - 1:], bank[T - 1:], ctx, None).logits)
    got = torch.cat(got)
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", ["sparse", "plain"])
def test_chained_drafts_match_the_reference(world, name):
    """``draft`` (Qwen3.5's k-step loop over this head): step 1 over positions 0..T-1, step i at position T+i-2 fed
    the previous step's output bank and draft; the reference appends the same bank and token to its inputs."""
    hf, ref, src, text_cfg, mtp_cfg, weights = world[name]
    from ninfer_qwen3_5.mtp import DraftRow
    from safetensors.torch import load_file

    src_tensors = load_file(src / "model.safetensors")
    cfg, head, kv = _head(text_cfg, mtp_cfg, weights)
    g = torch.Generator().manual_seed(9)
    T, k = 11, 4
    tokens_next = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    bank = torch.randn(T, cfg.hc_width, generator=g)
    assert kv.ensure(0, T + k, write_from=0)
    got = head.draft(kv, [DraftRow(0, 0, T)], tokens_next, bank, k)
    toks, banks = tokens_next, bank
    for i in range(k):
        logits, out = _reference(hf, ref, src_tensors, toks, banks)
        torch.testing.assert_close(got.logits[0, i], logits[-1], atol=2e-4, rtol=2e-4)
        d = int(logits[-1].argmax())
        assert int(got.tokens[0, i]) == d
        toks = torch.cat((toks, torch.tensor([d])))
        banks = torch.cat((banks, out[-1:]))


def test_mtp_step_returns_the_output_bank_of_logit_rows(world):
    hf, ref, src, text_cfg, mtp_cfg, weights = world["plain"]
    cfg, head, kv = _head(text_cfg, mtp_cfg, weights)
    T = 6
    tokens_next = torch.arange(T)
    bank = torch.randn(T, cfg.hc_width, generator=torch.Generator().manual_seed(2))
    assert kv.ensure(0, T, write_from=0)
    ctx = mtp_step_context(kv, chunks=[(0, 0, T)], device=torch.device("cpu"))
    full = head.forward(tokens_next, bank, ctx, None)
    picked = head.forward(tokens_next, bank, ctx, torch.tensor([5, 2]))
    torch.testing.assert_close(picked.logits, full.logits[[5, 2]])
    assert picked.hidden.shape == (2, cfg.hc_width)
    torch.testing.assert_close(picked.hidden, full.hidden[[5, 2]])


@pytest.mark.parametrize("inject, match", [
    (dict(bad="mtp.fc_hidden.weight"), "mtp.fc_hidden.weight"),
    (dict(bad="mtp.layers.0.self_attn.indexer.index_qk_proj.weight"), "index_qk_proj"),
    (dict(drop="mtp.hyper_connection_mixer.hc_norm.weight"), "mtp.hyper_connection_mixer.hc_norm.weight"),
])
def test_inconsistent_mtp_tensors_are_refused_by_name(tmp_path, inject, match):
    _, _, src = _checkpoint(tmp_path, "plain", **inject)
    with pytest.raises(Exception, match=match.replace(".", r"\.")):
        convert_checkpoint(src, tmp_path / "model.ninfer")


def test_mtp_without_its_layer_count_is_refused(tmp_path):
    _, _, src = _checkpoint(tmp_path, "plain")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="mtp_num_hidden_layers"):
        convert_checkpoint(src, tmp_path / "model.ninfer")


def test_mtp_head_refuses_two_layers_and_bad_banks(world):
    _, _, _, text_cfg, mtp_cfg, weights = world["plain"]
    from ninfer.errors import NotSupportedError

    cfg = Qwen4ExpConfig.from_compact(text_cfg)
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    with pytest.raises(NotSupportedError, match="mtp_num_hidden_layers=2"):
        Qwen4ExpMTPHead(cfg, dict(mtp_cfg, mtp_num_hidden_layers=2), weights, weights["text/embed"],
                        weights["text/lm_head"], ops, torch.device("cpu"), torch.float32)
    cfg, head, kv = _head(text_cfg, mtp_cfg, weights)
    assert kv.ensure(0, 2, write_from=0)
    ctx = mtp_step_context(kv, chunks=[(0, 0, 2)], device=torch.device("cpu"))
    with pytest.raises(Exception, match="streams"):
        head.forward(torch.arange(2), torch.zeros(2, cfg.hidden_size), ctx, None)

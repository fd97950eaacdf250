"""Activation recomputation: what the ledger measures per mode against theory, and unchanged gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench import trace
from workbench.models.gpt import GPTConfig, build_gpt
from workbench.recompute import RECOMPUTE_MODES, apply_recompute
from workbench.theory.memory import RECOMPUTE_MODES as THEORY_MODES
from workbench.theory.memory import activation_bytes, gpt_block_activation_bytes

BATCH = 2


def _batch(cfg: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, cfg.seq_len)
    return torch.randint(0, cfg.vocab_size, shape, generator=g), torch.randint(0, cfg.vocab_size, shape, generator=g)


def _saved_bytes(n_layer: int, mode: str) -> tuple[int, int]:
    """(bytes the ledger counts over one forward, its activations peak once backward is done)."""
    cfg = GPTConfig.preset("tiny", n_layer=n_layer)
    model = apply_recompute(build_gpt(cfg), mode)
    x, y = _batch(cfg)
    with trace.tracing() as tracer:
        with tracer.activations():
            loss = model(x, y)
        forward = tracer.memory.current["activations"]
        loss.backward()
        return forward, tracer.memory.peak["activations"]


def test_modes_agree_with_theory() -> None:
    assert RECOMPUTE_MODES == THEORY_MODES


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_saved_activations_per_layer_match_theory(mode: str) -> None:
    """Per layer (the difference between a 3- and a 2-layer model, so the embedding, head and loss cancel):

    - none: exactly ``gpt_block_activation_bytes`` (what autograd saves for one block of this GPT);
    - full: exactly ``activation_bytes(recompute="full")``, the block's input p·sbh;
    - selective: ``gpt_block_activation_bytes`` less the fused kernel's log-sum-exp, 4·a·s·b bytes. Theory's
      "selective" drops the paper's as²b terms (softmax, its dropout and mask), which PyTorch's fused
      attention never keeps in the first place: in this GPT they are already recomputed, so recomputing the
      attention core only removes what stands in for them.
    """
    cfg = GPTConfig.preset("tiny")
    (two, peak_two), (three, _) = _saved_bytes(2, mode), _saved_bytes(3, mode)
    per_layer = three - two
    block = gpt_block_activation_bytes(BATCH, cfg.seq_len, cfg.d_model, cfg.n_head)
    expected = {
        "none": block,
        "selective": block - 4 * cfg.n_head * cfg.seq_len * BATCH,
        "full": activation_bytes(BATCH, cfg.seq_len, cfg.d_model, 1, cfg.n_head, recompute="full"),
    }[mode]
    assert per_layer == expected
    assert peak_two == two, "the backward's recomputation must not count as forward activations"


def test_recompute_saves_less_and_the_rest_is_unchanged() -> None:
    none, selective, full = (_saved_bytes(2, m)[0] for m in RECOMPUTE_MODES)
    assert full < selective < none
    cfg = GPTConfig.preset("tiny")
    block = gpt_block_activation_bytes(BATCH, cfg.seq_len, cfg.d_model, cfg.n_head)
    # What lies outside the blocks (embeddings, final norm, head, loss) is the same in every mode.
    assert none - 2 * block == full - 2 * activation_bytes(BATCH, cfg.seq_len, cfg.d_model, 1, cfg.n_head,
                                                           recompute="full")


def _add_dropout(model: torch.nn.Module, p: float = 0.2) -> None:
    """Dropout after each attention and MLP (this GPT has none): forward hooks run inside the caller's
    forward, so under "full" they are inside the recomputed region and must redraw the same masks."""
    for block in model.blocks:
        for sub in (block.attn, block.mlp):
            sub.register_forward_hook(lambda module, args, out: F.dropout(out, p, training=True))


def _grads(mode: str, dropout: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cfg = GPTConfig.preset("tiny")
    model = build_gpt(cfg)
    if dropout:
        _add_dropout(model)
    apply_recompute(model, mode)
    x, y = _batch(cfg)
    torch.manual_seed(123)  # the dropout masks' stream, the same for every mode
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_gradients_are_bit_identical_to_no_recomputation(mode: str, dropout: bool) -> None:
    """Same ops on the same inputs (CPU kernels are deterministic) and, with dropout, the same RNG state
    replayed by the checkpoint: loss and every gradient equal bit for bit (tolerance 0)."""
    ref_loss, ref = _grads("none", dropout)
    loss, grads = _grads(mode, dropout)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for name in ref:
        assert torch.equal(grads[name], ref[name]), name


def test_dropout_really_differs_between_draws() -> None:
    """Guards the test above: the dropout hooks change the result, so matching gradients mean matching masks."""
    assert not torch.equal(_grads("none", True)[0], _grads("none", False)[0])


def test_no_grad_forward_is_unchanged() -> None:
    cfg = GPTConfig.preset("tiny")
    x, _ = _batch(cfg)
    with torch.no_grad():
        ref = build_gpt(cfg)(x)
        for mode in ("selective", "full"):
            assert torch.equal(apply_recompute(build_gpt(cfg), mode)(x), ref)


def test_bad_mode_names_valid_modes() -> None:
    with pytest.raises(ValueError, match="unknown recompute mode 'partial'; valid modes: 'none', 'selective', 'full'"):
        apply_recompute(build_gpt(GPTConfig.preset("tiny")), "partial")


def test_applying_twice_or_to_a_wrapper_is_refused() -> None:
    model = apply_recompute(build_gpt(GPTConfig.preset("tiny")), "full")
    with pytest.raises(ValueError, match="already applied"):
        apply_recompute(model, "selective")
    with pytest.raises(ValueError, match="needs a workbench.models.gpt.GPT"):
        apply_recompute(torch.nn.Sequential(build_gpt(GPTConfig.preset("tiny"))), "full")
    plain = torch.nn.Linear(2, 2)
    assert apply_recompute(plain, "none") is plain


def test_run_flag_reaches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from workbench.cli import _config_from_args, build_parser

    args = build_parser().parse_args(["run", "--recompute", "selective", "--batch-size", "8", "--seq-len", "32"])
    assert _config_from_args(args).recompute == "selective"
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--recompute", "some"])
    assert info.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err

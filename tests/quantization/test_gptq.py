"""GPTQ: the algorithm against the reference implementation, and `llmserve quantize --method gptq` end to end (the
written layout, served on the int4 kernels, greedy-equal to transformers on the written values)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from llmserve import LLM, SamplingParams
from llmserve.cli import main as cli_main
from llmserve.evaluate.reference import quantized_reference, reference_greedy
from llmserve.loader import load_checkpoint
from llmserve.quantization.gptq import GPTQConfig, gptq_linear
from llmserve.quantization.int4_groups import fit_groups
from llmserve.quantization.weight_only import WeightOnlyLinear
from tests.greedy import assert_greedy_equals
from tests.quantization.tiny_models import make_tiny_hf_dir


class _ReferenceQuantizer:
    """AutoGPTQ 0.7.1's `Quantizer` (bits 4, per channel), with one change: the scale rounded to fp16 before it is
    used, as ours is (AutoGPTQ rounds it only when it writes it)."""

    def find_params(self, x: torch.Tensor, sym: bool) -> None:
        zero = torch.zeros(x.shape[0])
        xmin, xmax = torch.minimum(x.min(1)[0], zero), torch.maximum(x.max(1)[0], zero)
        if sym:
            xmax = torch.maximum(torch.abs(xmin), xmax)
            tmp = xmin < 0
            if torch.any(tmp):
                xmin[tmp] = -xmax[tmp]
        tmp = (xmin == 0) & (xmax == 0)
        xmin[tmp], xmax[tmp] = -1, +1
        scale = ((xmax - xmin) / 15).half().float()
        zero = torch.full_like(scale, 8) if sym else torch.round(-xmin / scale)
        self.scale, self.zero = scale.reshape(-1, 1), zero.reshape(-1, 1)  # weight=True: one per row

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.clamp(torch.round(x / self.scale) + self.zero, 0, 15)
        return self.scale * (q - self.zero)


def _reference_gptq(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool, act_order: bool,
                    percdamp: float = 0.01, blocksize: int = 128) -> torch.Tensor:
    """AutoGPTQ 0.7.1's `GPTQ.fasterquant` as written there (static groups with act order), the dequantized weight."""
    W = weight.clone().float()
    columns = W.shape[1]
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    quantizer = _ReferenceQuantizer()
    groups = []
    if act_order:  # static_groups
        for i in range(0, columns, group_size):
            q = copy.deepcopy(quantizer)
            q.find_params(W[:, i:(i + group_size)], sym)
            groups.append(q)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        invperm = torch.argsort(perm)
    Q = torch.zeros_like(W)
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if not act_order:
                if (i1 + i) % group_size == 0:
                    quantizer.find_params(W[:, (i1 + i):(i1 + i + group_size)], sym)
            else:
                quantizer = groups[perm[i1 + i] // group_size]
            q = quantizer.quantize(w.unsqueeze(1)).flatten()
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return Q[:, invperm] if act_order else Q


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [96, 256], correlated calibration inputs as real activations are (and a dead input), their Hessian."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 32, generator=generator) @ torch.randn(32, 256, generator=generator)
    x += 0.3 * torch.randn(2048, 256, generator=generator)
    x[:, 5] = 0
    weight = torch.randn(96, 256, generator=generator) * 0.05
    return weight, x, 2 * x.t() @ x / len(x)


@pytest.mark.parametrize(("group_size", "sym", "act_order"),
                         [(128, True, False), (128, False, False), (32, True, True), (64, False, True)])
def test_gptq_equals_the_reference_implementation(group_size, sym, act_order):
    # (groups of 128: where a group starts inside a block the reference fits it on weights not yet updated within the
    # block, ours on the updated ones)
    weight, _, hessian = _layer()
    groups = gptq_linear(weight, hessian, GPTQConfig(group_size=group_size, sym=sym, act_order=act_order))
    expected = _reference_gptq(weight, hessian, group_size, sym, act_order)
    torch.testing.assert_close(groups.dequantize(), expected, rtol=0, atol=1e-6)
    assert groups.q.dtype == torch.int32 and int(groups.q.min()) >= 0 and int(groups.q.max()) <= 15
    assert (groups.zeros == 8).all() == sym
    assert torch.equal(groups.dequantize()[:, 5], torch.zeros(96))  # a dead input's weights are zero


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_on_its_inputs(act_order):
    weight, x, hessian = _layer(seed=1)
    for group_size in (32, 128):
        gptq = gptq_linear(weight, hessian, GPTQConfig(group_size=group_size, sym=False, act_order=act_order))
        rtn = fit_groups(weight, group_size)

        def error(w: torch.Tensor) -> float:
            return float(((x @ (w - weight).t()) ** 2).mean())

        assert error(gptq.dequantize()) < 0.2 * error(rtn.dequantize())


def test_bad_settings_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="multiple of 32"):
        GPTQConfig(group_size=48)
    with pytest.raises(ValueError, match="damp_percent"):
        GPTQConfig(damp_percent=0)
    tiny = make_tiny_hf_dir(tmp_path / "tiny", "llama", hidden=64, intermediate=128, layers=1)
    assert cli_main(["quantize", str(tiny), "--method", "gptq", "--group-size", "128",
                     "--out", str(tmp_path / "x")]) == 2
    assert "does not divide the 64 input features" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n\n")
    for calibration, message in ((tmp_path / "none.txt", "No such file"), (tmp_path / "empty.txt", "is empty")):
        assert cli_main(["quantize", str(tiny), "--method", "gptq", "--group-size", "32", "--calibration",
                         str(calibration), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny"), "qwen2", kv_heads=2, hidden=128, intermediate=256)


@pytest.mark.parametrize("options", [[], ["--sym", "--act-order"]], ids=["asym", "sym-act-order"])
def test_a_written_checkpoint_serves_the_values_it_holds(tiny, tmp_path, options):
    out = tmp_path / "gptq"
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "\n\ndef f(a, b):\n    return a\n")
    assert cli_main(["quantize", str(tiny), "--method", "gptq", "--group-size", "32", *options,
                     "--calibration", str(calibration), "--out", str(out)]) == 0
    asym = "--sym" not in options
    written = json.loads((out / "config.json").read_text())
    assert written["llmserve_quantization"]["calibration"] == "calibration.txt"
    config = written["quantization_config"]
    assert config == json.loads((out / "quantize_config.json").read_text())
    assert config == {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": not asym,
                      "static_groups": not asym,
                      "sym": not asym, "true_sequential": True, "damp_percent": 0.01,
                      "checkpoint_format": "gptq_v2" if asym else "gptq"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (256 // 8, 128)  # [in / 8, out]
        assert torch.equal(f.get_tensor("model.layers.1.self_attn.o_proj.g_idx"),
                           (torch.arange(128) // 32).to(torch.int32))
    assert "model.layers.0.self_attn.q_proj.bias" in names and not any(
        n.endswith("proj.weight") and ".layers." in n for n in names)

    ckpt = load_checkpoint(str(out))
    source = load_checkpoint(str(tiny))
    name = "model.layers.1.mlp.down_proj.weight"
    assert ckpt.source_formats[name] == "GPTQ" and ckpt.int4_groups[name].group_size == 32
    assert not torch.equal(ckpt.weights[name], fit_groups(source.weights[name], 32).dequantize())  # not rounding
    assert torch.equal(ckpt.weights["model.layers.0.input_layernorm.weight"],
                       source.weights["model.layers.0.input_layernorm.weight"])  # nothing folded

    # the values the int4 layers hold: the written ones exactly where z * s is an fp16 value (symmetric: z = 8), else
    # with the group's minimum -z * s rounded to fp16 (quantization/int4_groups.py)
    held = {n: WeightOnlyLinear(ckpt.weights[n], "int4", grid=ckpt.int4_grids[n]).weight for n in ckpt.int4_groups}
    assert all(torch.equal(held[n], ckpt.weights[n]) for n in held) == (not asym)
    largest = float(ckpt.weights[name].abs().max())
    torch.testing.assert_close(held[name], ckpt.weights[name], rtol=0, atol=1e-3 * largest)
    served = LLM(str(out), kv_cache_memory_gb=0.05, dtype="float32")  # auto: int4, as stored, not quantized again
    assert served.engine.plan.weights == "int4"
    down = dict(served.engine.runner.model.named_modules())["layers.1.mlp.down_proj"]
    assert isinstance(down, WeightOnlyLinear) and torch.equal(down.qweight, WeightOnlyLinear(
        ckpt.weights[name], "int4", native_kernels=down.native, grid=ckpt.int4_grids[name]).qweight)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    again = LLM(str(out), kv_cache_memory_gb=0.05, dtype="float32")  # read twice: the same tokens
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert ([o.outputs[0].token_ids for o in served.generate(prompts, params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in again.generate(prompts, params, use_tqdm=False)])


@pytest.mark.slow
def test_gptq_smollm2_greedy_equals_transformers_on_the_written_values(hf_model, prompt_token_ids, tmp_path):
    """slow: GPTQ over SmolLM2 (~60 s on 2 cores). The served directory's greedy tokens, batched and alone, equal
    transformers' with the values our int4 layers hold (each group's minimum -z * s as the int4 kernels round it to
    fp16) and our int8 head."""
    assert cli_main(["quantize", "--method", "gptq", "--group-size", "32", "--out", str(tmp_path)]) == 0
    ckpt = load_checkpoint(str(tmp_path))
    written = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in written.named_parameters():
            if name in ckpt.int4_groups:
                param.copy_(ckpt.weights[name])
    reference = quantized_reference(written, "int4", ckpt.grids)
    expected = [reference_greedy(reference, ids, 16) for ids in prompt_token_ids]
    # prompts on the dense products of the same values (auto would give a 4-bit file int8 x int8 large steps on this
    # CPU, which the reference does not model)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gb=0.25, max_model_len=2048, large_steps="dense")
    assert llm.engine.plan.weights == "int4"
    assert_greedy_equals(llm, prompt_token_ids, expected, single=3)

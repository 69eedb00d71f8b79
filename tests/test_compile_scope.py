"""A stage compiled as one region (``performance.compile_scope = "stage"``) runs on whichever weight version is
swapped in, without recompiling, and matches the layers run one by one."""
import torch
import torch._dynamo
from transformers import LlamaConfig

from ds_async.config import PerformanceConfig
from ds_async.models import compile_line, compiled_stage, llama
from distributed import two_versions


def test_compiled_stage_follows_the_swapped_in_version_without_recompiling():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=2, vocab_size=50, max_position_embeddings=16, tie_word_embeddings=False)
    llama.check_supported(cfg)
    layers = [llama.DecoderLayerPipe(cfg, i, seed=3) for i in range(2)] + [llama.HeadPipe(cfg, seed=3, index=3)]
    stage = torch.nn.ModuleList(layers)
    versions = two_versions(stage)

    def eager(x):
        for layer in layers:
            x = layer(x)
        return x

    torch._dynamo.reset()
    run = compiled_stage(layers, backend="aot_eager")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    results = {}
    for step, version in enumerate([0, 1, 0, 1]):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for name, fn in (("compiled", run), ("eager", eager)):
                versions.point_at(version)
                out = fn(x)
                out.square().mean().backward()
                slot = versions.slots[versions._slot(version)]
                results[name] = (out.detach(), [t.grad.clone() for t in slot])
                for t in slot:
                    t.grad = None
        (got, got_grads), (want, want_grads) = results["compiled"], results["eager"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # The two versions gave different outputs: the compiled region did read the swapped-in tensors.
    versions.point_at(0)
    out0 = run(x)
    versions.point_at(1)
    assert not torch.allclose(out0, run(x))
    versions.restore_master()


def test_a_compiling_run_says_why_its_first_step_waits_and_where_the_code_is_kept(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    monkeypatch.setenv("CACHE_ROOT", "/scratch")
    assert compile_line(PerformanceConfig()) is None
    stage = compile_line(PerformanceConfig(compile=True, compile_scope="stage", compile_cache="$CACHE_ROOT/cc"))
    assert stage.startswith("ds_async: the first step compiles each stage's layers as one region")
    assert "kept in /scratch/cc for later runs" in stage
    layer = compile_line(PerformanceConfig(compile=True, compile_cache=None))
    assert "one decoder layer, which the others reuse" in layer and "TORCHINDUCTOR_CACHE_DIR" in layer
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert compile_line(PerformanceConfig(compile=True)) is None
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # what TORCH_COMPILE_DISABLE=1 sets
    assert compile_line(PerformanceConfig(compile=True)) is None

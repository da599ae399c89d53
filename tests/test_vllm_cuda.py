"""vLLM on CUDA: what vLLM's CPU build cannot run (benchmarks/gpu_check.sh runs these).

Marked `cuda`; skipped where torch sees no CUDA device or the installed vLLM is not a CUDA build
(`pip install 'cppo[vllm]'`). Written against vLLM 0.32's and TRL 1.16's APIs but NOT run in this
project's CI (no GPU there): docs/recipes.md says so.

- colocate with sleep mode (level 2 after each generation, weights pushed on waking): a 3-step
  `cppo train --use_vllm true` on the embedded default, finite losses, a checkpoint, no
  "no sleep mode" line;
- server mode with the NCCL weight push (2 GPUs: the server on the second, the trainer on the
  first): after an optimizer step and a push, the server's log-probs are the updated policy's.
"""

import os
import subprocess
import time

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def cuda_vllm():
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (the lent GPU machine's image has "
                                              "none): its CUDA build is pip install 'cppo[vllm]'")
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        pytest.skip("the installed vLLM is not a CUDA build")
    return vllm


def test_colocate_with_sleep_mode_trains_three_steps(tmp_path):
    cuda_vllm()
    from test_vllm_engine import losses, run_cli
    out = tmp_path / "run"
    run = run_cli(["train", "--use_vllm", "true", "--output_dir", str(out), "--max_steps", "3",
                   "--eval_num_questions", "8", "--per_device_train_batch_size", "16",
                   "--vllm_gpu_memory_utilization", "0.2", "--progress_bar", "false"])
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "no sleep mode" not in run.stdout
    values = losses(out)
    assert len(values) == 3 and all(torch.isfinite(torch.tensor(values)))
    assert (out / "checkpoint-3").is_dir()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the server and the trainer need a GPU each")
def test_server_push_over_nccl_gives_the_updated_policy(tmp_path):
    cuda_vllm()
    pytest.importorskip("trl", reason="TRL is not installed (its `trl vllm-serve` runs the server)")
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from helpers.vllm_servers import healthy
    from cppo.assembly.run import backend_settings
    from cppo.config import CPPOConfig
    from cppo.parallel.processes import free_port
    from cppo.sampling.vllm import VLLMBackend
    from cppo.models import load_model, load_tokenizer
    from cppo.models.tokenizer import build_tokenizer
    from cppo.sampling.logprobs import completion_logprobs
    from cppo.sampling.sampler import encode_prompts
    from test_vllm_engine import save_tiny_model
    path = save_tiny_model(tmp_path / "model", build_tokenizer(), tied=True)
    port = free_port()
    command = build_command(ScriptArguments(model=path, host="127.0.0.1", port=port,
                                            dtype="float32", gpu_memory_utilization=0.2,
                                            max_model_len=256))   # what `trl vllm-serve` execs
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", CUDA_VISIBLE_DEVICES="1")
    server = subprocess.Popen(command, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        healthy(f"http://127.0.0.1:{port}", server, time.time() + 600)
        model, tok = load_model(path).to("cuda:0"), load_tokenizer(path)
        args = CPPOConfig(use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_group_port=free_port(),
                          num_generations=4, max_completion_length=8, max_prompt_length=64)
        backend = VLLMBackend(model, tok, backend_settings(args))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))   # the policy moves away from the saved weights
        prompts = encode_prompts(tok, ["12*34=", "5*6="], 64).to("cuda:0")
        out = backend.generate(prompts, round_index=1)
        with torch.no_grad():
            policy = completion_logprobs(model, prompts.ids.repeat_interleave(4, 0),
                                         prompts.mask.repeat_interleave(4, 0), out.ids, out.mask)
        valid = out.mask.bool()
        assert float((policy - out.logprobs)[valid].abs().max()) <= 1e-3
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


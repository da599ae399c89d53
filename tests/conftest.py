import pytest
import torch

torch.set_num_threads(1)  # 2 threads on a busy 2-core machine spin badly (OpenMP)

# The longest files, most of them starting processes of their own (torchrun groups, vLLM engines,
# killed children), the two longest first: under `pytest -n 2` (one file per worker, in this order)
# those two start at once on different workers and the short files fill in around the long ones,
# instead of a long one starting last.
LONGEST_FIRST = ("test_distributed.py", "test_cpu_paths.py", "test_vllm_engine.py",
                 "test_reliability_crash.py", "test_vllm_server.py", "test_vllm_servers.py",
                 "test_trl_differential.py")


# The files that also run in the README's plain install (no extras, the newest dependencies pip
# resolves): .ci/run runs `pytest -m plain_install` there. The trainer, config, checkpoints,
# evaluation, rewards and data; what needs an extra inside them is skipped where it is missing.
PLAIN_INSTALL = ("test_install.py", "test_config.py", "test_trainer.py", "test_task.py",
                 "test_rewards_answers.py", "test_rewards_math.py", "test_reliability_outputs.py",
                 "test_reliability_errors.py", "test_eval_user_data.py", "test_data_loaders.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in PLAIN_INSTALL:
            item.add_marker(pytest.mark.plain_install)

    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)   # stable: each file keeps its own order


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from cppo.models.tokenizer import build_tokenizer
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A randomly initialised tiny Llama with the task tokenizer, saved as a model directory."""
    from transformers import LlamaForCausalLM
    from cppo.models.loading import tiny_model_config
    torch.manual_seed(0)
    tok = tiny_tokenizer
    model = LlamaForCausalLM(tiny_model_config(len(tok), bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, hidden_size=32,
                                               num_layers=2, num_heads=2, intermediate_size=64))
    return saved(tmp_path_factory, "tiny_model", model, tok)


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory, tiny_tokenizer):
    """tiny_model_dir's model with an LM head of its own (tie_word_embeddings false), as TRL's
    cast_lm_head_to_fp32 asks, and twice the width."""
    from transformers import LlamaForCausalLM
    from cppo.models.loading import tiny_model_config
    torch.manual_seed(0)
    tok = tiny_tokenizer
    config = tiny_model_config(len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, hidden_size=64, num_layers=2,
                               num_heads=2, intermediate_size=128)
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    return saved(tmp_path_factory, "untied_model", model, tok)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random Qwen3-MoE with the task tokenizer, its config's router_aux_loss_coef 0.001."""
    from helpers.tiny_hf import build_moe
    tok = tiny_tokenizer
    model = build_moe(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id)
    return saved(tmp_path_factory, "tiny_moe", model, tok)


def saved(tmp_path_factory, name: str, model, tokenizer) -> str:
    """The model and its tokenizer saved to a new temporary folder; its path."""
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

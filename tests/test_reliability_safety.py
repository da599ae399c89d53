"""Safe loading: model weights only from safetensors, checkpoint tensors only with
weights_only=True, and no evaluation of text as code anywhere in the package.

The pickles here carry a real payload (unpickling creates a marker file), so "refused" means the
payload never ran, not only that an exception was raised."""

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch

from cppo.run import checkpoint as ckpt
from cppo.models import load_model
from cppo.errors import ModelLoadError

SRC = Path(__file__).resolve().parents[1] / "src" / "cppo"


class Payload:
    """Unpickling this creates the file `marker`: stands for arbitrary code in a pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_model_loading_asks_transformers_for_safetensors_only(monkeypatch, tiny_model_dir):
    import transformers
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_model(tiny_model_dir)
    assert seen.get("use_safetensors") is True


def test_a_pickle_next_to_the_safetensors_is_never_opened(tmp_path, tiny_model_dir):
    import shutil
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "payload_ran"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, model_dir / "pytorch_model.bin")
    model = load_model(str(model_dir))
    assert not marker.exists()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_directory_with_only_pickle_weights_is_refused(tmp_path, tiny_model_dir):
    from transformers import AutoConfig
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    AutoConfig.from_pretrained(tiny_model_dir).save_pretrained(model_dir)
    marker = tmp_path / "payload_ran"
    torch.save({"w": Payload(marker)}, model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"only PyTorch pickle weights \(pytorch_model.bin\).*"
                       r"loads weights only from safetensors"):
        load_model(str(model_dir))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pt"])
def test_checkpoint_files_with_pickled_objects_are_refused(tmp_path, name):
    marker = tmp_path / "payload_ran"
    path = tmp_path / name
    torch.save({"state": {0: {"step": torch.tensor(1.0)}}, "extra": Payload(marker)}, path)
    with pytest.raises(ckpt.CheckpointError, match=f"refusing to load .*{name}: it holds pickled objects"):
        ckpt.load_tensors(path)
    assert not marker.exists()
    torch.save({"state": {0: {"step": torch.tensor(1.0)}}, "lr": [0.1], "name": "adamw"}, path)
    assert ckpt.load_tensors(path)["lr"] == [0.1]        # plain tensors and containers load


def test_checkpoint_without_safetensors_weights_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="no .safetensors weights"):
        ckpt.load_model_weights(torch.nn.Linear(2, 2), tmp_path)


def _python_files():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    return files


def test_no_eval_or_exec_of_text_in_the_package():
    """The builtins eval/exec/compile/__import__ are never called (docstrings and comments may
    name them; `model.eval()` is a method): model output is never run as code."""
    calls = []
    for path in _python_files():
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
        for before, tok, after in zip(tokens, tokens[1:], tokens[2:]):
            if (tok.type == tokenize.NAME and tok.string in ("eval", "exec", "compile", "__import__")
                    and after.string == "(" and before.string not in (".", "def")):
                calls.append(f"{path.relative_to(SRC)}:{tok.start[0]}: {tok.line.strip()}")
    assert calls == []


def test_every_torch_load_is_weights_only_and_nothing_unpickles():
    unsafe = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            where = f"{path.relative_to(SRC)}:{node.lineno}"
            if owner == "torch" and node.func.attr == "load":
                flag = {k.arg: k.value for k in node.keywords}.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    unsafe.append(where)
            if owner in ("pickle", "dill", "cloudpickle", "marshal") and node.func.attr in ("load", "loads"):
                unsafe.append(where)
    assert unsafe == []


def test_the_eval_grep_can_fail(tmp_path, monkeypatch):
    """The scanner above sees a real call (so its passing means something)."""
    bad = tmp_path / "pkg"
    bad.mkdir()
    for i in range(21):
        (bad / f"m{i}.py").write_text('"""eval(x) in a docstring is fine"""\nmodel.eval()\n')
    (bad / "evil.py").write_text("def f(text):\n    return eval(text)\n")
    monkeypatch.setattr(__import__(__name__), "SRC", bad)
    with pytest.raises(AssertionError, match=r"evil.py:2"):
        test_no_eval_or_exec_of_text_in_the_package()

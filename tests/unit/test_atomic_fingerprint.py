import shutil

import pytest

from eagleflow.common.atomic import atomic_path, write_json
from eagleflow.common.fingerprint import ROOT, code_fingerprint


def test_failed_write_leaves_the_old_file_and_no_temporaries(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text().strip().endswith("}") and '"v": 1' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_directory_outputs_are_replaced_whole(tmp_path):
    target = tmp_path / "draft"
    for version in ("a", "b"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / version).write_text(version)
    assert [p.name for p in target.iterdir()] == ["b"]


@pytest.fixture
def scripts(tmp_path):
    root = tmp_path / "eagleflow"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_fingerprint_ignores_comments_and_docstrings(scripts):
    before = code_fingerprint("eagleflow.vocab", scripts)
    path = scripts / "vocab.py"
    path.write_text(path.read_text().replace('"""vocab:', '# a new comment\n"""vocab: reworded.', 1))
    code_fingerprint.cache_clear()
    assert code_fingerprint("eagleflow.vocab", scripts) == before


def test_fingerprint_follows_imports_transitively(scripts):
    before = code_fingerprint("eagleflow.vocab", scripts)
    other = code_fingerprint("eagleflow.prompts.run", scripts)
    atomic = scripts / "common" / "atomic.py"  # imported by vocab
    atomic.write_text(atomic.read_text().replace("os.fsync(fh.fileno())", "pass"))
    code_fingerprint.cache_clear()
    assert code_fingerprint("eagleflow.vocab", scripts) != before
    # prompts imports atomic too
    assert code_fingerprint("eagleflow.prompts.run", scripts) != other
    unrelated = code_fingerprint("eagleflow.benchmark.metrics", scripts)  # imports no atomic
    code_fingerprint.cache_clear()
    assert code_fingerprint("eagleflow.benchmark.metrics", scripts) == unrelated


def test_a_module_that_runs_in_a_server_process_keys_the_stage_that_names_it(scripts):
    """vLLM loads the hidden-states connector and the benchmark's server by module path, in its
    own process: no import in the stage's code runs them, and `runs_module` puts them in its
    fingerprint all the same."""
    from eagleflow.common.fingerprint import module_digests

    assert "eagleflow.hidden_states.vllm_connector" in module_digests("eagleflow.entry.hidden_states", scripts)
    assert "eagleflow.benchmark.vllm_serve" in module_digests("eagleflow.entry.benchmark", scripts)
    before = code_fingerprint("eagleflow.entry.hidden_states", scripts)
    connector = scripts / "hidden_states" / "vllm_connector.py"
    connector.write_text(connector.read_text() + "\n_EDIT = 1\n")
    code_fingerprint.cache_clear()
    assert code_fingerprint("eagleflow.entry.hidden_states", scripts) != before

"""The boundary between code that decides a stage's outputs and code that only runs it
(workflow/eagleflow/runtime): run-only code is in no fingerprint, imports no stage, and what of
it can change a result reaches the keys as data (runtime/server_args.py)."""

import ast

from devkit.configs import server_config
from eagleflow.common.fingerprint import ROOT, _module_file, is_runtime, module_digests
from eagleflow.runtime.server_args import RUN_ONLY_FLAGS, result_args
from eagleflow.runtime.spec import ServerSpec

PACKAGE = "eagleflow"


def modules() -> list[str]:
    """Every module of the package, by name."""
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts)))
    return names


def direct_imports(module: str) -> set[str]:
    path = _module_file(module, ROOT)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {m for m in found if m.startswith(PACKAGE + ".")}


def entry_points() -> list[str]:
    return [m for m in modules() if m.startswith(f"{PACKAGE}.entry.")]


def test_runtime_imports_no_stage_module():
    """Run-only code may use the shared result-side helpers (common) and itself, nothing of a
    stage: a stage module it imported would run outside every fingerprint."""
    for module in filter(is_runtime, modules()):
        stray = {m for m in direct_imports(module) if not (is_runtime(m) or m.startswith(f"{PACKAGE}.common"))}
        assert not stray, f"{module} imports stage code {sorted(stray)}"


def test_the_shared_result_side_imports_run_only_code_once_and_as_data():
    """common/ is result-side code every fingerprint includes; run-only code is in none. One
    import crosses that line, by design: common.requests keys a request by the server's result
    flags, which runtime.server_args reads (its classification reaches the keys as the flags it
    returns, data, not as code in the fingerprint; docs/invalidation.md, "Server flags")."""
    crossing = {
        (module, imported)
        for module in modules()
        if module.startswith(f"{PACKAGE}.common")
        for imported in direct_imports(module)
        if is_runtime(imported)
    }
    assert crossing == {(f"{PACKAGE}.common.requests", f"{PACKAGE}.runtime.server_args")}


def test_every_module_is_on_exactly_one_side():
    """A result-side module is in some rule's fingerprint (an edit restales that rule); a
    run-only one is in none. A result-side module only runtime imports would be neither."""
    fingerprinted = set().union(*(module_digests(e) for e in entry_points()))
    assert not {m for m in fingerprinted if is_runtime(m)}
    # Result-side modules that no rule runs build the DAG (eagleflow.dag, and the plan's
    # command): no stage imports them.
    dag_only = {m for m in modules() if m in (f"{PACKAGE}.dag", f"{PACKAGE}.plan") or m.startswith(f"{PACKAGE}.dag.")}
    assert not dag_only & fingerprinted
    imported_by_runtime = set().union(*(direct_imports(m) for m in modules() if is_runtime(m)))
    for module in modules():
        if is_runtime(module) or module in dag_only or module.endswith("__main__"):
            continue
        assert module in fingerprinted, f"{module} is result-side code that no rule's fingerprint includes"
    assert {m for m in imported_by_runtime if not is_runtime(m)} <= fingerprinted


def test_one_list_of_run_only_flags_decides_both_keys(tmp_path):
    """generate's store key and the shard cache's key take the launcher's argv through
    result_args: a result flag changes both, a run-only setting neither."""
    from devkit.configs import hidden_states_config
    from eagleflow.common.requests import server_identity
    from eagleflow.hidden_states.run import content_settings

    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")

    def launched(**server) -> list[str]:
        return ServerSpec.from_config(server_config(**server), str(verifier)).command(port=8000)

    def keys(**server) -> tuple:
        argv = launched(**server)
        settings = content_settings(hidden_states_config(backend="vllm"), result_args(argv), [1, 2], False, "c")
        return server_identity(verifier, argv), settings

    base = keys()
    for changed in (
        {"dtype": "bfloat16"},
        {"extra_args": ["--seed", "1"]},
        {"max_model_len": 64},
        {"tensor_parallel_size": 2},
        {"enforce_eager": False},
        {"extra_args": ["-q", "fp8"]},
    ):
        assert all(a != b for a, b in zip(keys(**changed), base, strict=True)), changed
    run_only = {
        "host": "0.0.0.0",
        "startup_timeout_s": 9,
        "extra_args": ["--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "512"],
    }
    assert keys(**run_only) == base
    flags = {g[0] for g in result_args(launched())}
    assert not flags & RUN_ONLY_FLAGS and {"--dtype", "--enforce-eager", "--tensor-parallel-size"} <= flags

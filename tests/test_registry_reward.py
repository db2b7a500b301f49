import pytest

from pytest_fsdp_turbo_engine import registry
from pytest_fsdp_turbo_engine.reward import closeness_reward, load_prompts


@pytest.fixture
def clean_registry():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_register_lists_and_lookup(clean_registry):
    @registry.register(model_type=["qwen3", "llama"], backend="mine", device=["cpu", "cuda"])
    class Mine:
        pass

    assert registry.lookup("llama", "mine", "cuda") is Mine
    assert (
        "qwen3",
        "mine",
        "cpu",
        "test_register_lists_and_lookup.<locals>.Mine",
    ) in registry.registered()


def test_wildcard_model_type(clean_registry):
    @registry.register(backend="any-model", device="cpu")
    class AnyModel:
        pass

    assert registry.lookup("whatever", "any-model", "cpu") is AnyModel


def test_duplicate_registration_is_an_error(clean_registry):
    @registry.register(backend="dup", device="cpu")
    class First:
        pass

    with pytest.raises(registry.RegistryError, match="already registered: .*First"):

        @registry.register(backend="dup", device=["npu", "cpu"])
        class Second:
            pass

    assert registry.lookup("x", "dup", "cpu") is First
    with pytest.raises(registry.RegistryError):
        registry.lookup("x", "dup", "npu")  # the failed registration left nothing behind


def test_lookup_error_lists_registered(clean_registry):
    @registry.register(backend="listed", device="cpu")
    class Listed:
        pass

    with pytest.raises(
        registry.RegistryError, match=r"no engine for .*backend='nope'.*\*/listed/cpu -> .*Listed"
    ):
        registry.lookup("llama", "nope", "cpu")


def test_engine_modules_env_var_is_imported(clean_registry, tmp_path, monkeypatch):
    (tmp_path / "downstream_engines.py").write_text(
        "from pytest_fsdp_turbo_engine.registry import register\n"
        "@register(backend='downstream', device='cpu')\n"
        "class Downstream: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.MODULES_VAR, "downstream_engines")
    registry.load_engine_plugins()
    assert registry.lookup("any", "downstream", "cpu").__name__ == "Downstream"
    assert registry.lookup("qwen3", "fsdp", "cpu").__name__ == "FSDPEngineWithLMHead"


def test_reward_is_dense_and_deterministic():
    assert closeness_reward(b"mmmm", "m") == 1.0
    assert closeness_reward(b"", "m") == 0.0
    assert closeness_reward(b"a", "m") == pytest.approx(1 - 12 / 255)
    random_like = [bytes([i, 200 - i, 37 + i]) for i in range(8)]
    assert len({closeness_reward(r, "m") for r in random_like}) == 8


def test_prompts_have_equal_length():
    prompts = load_prompts()
    assert len(prompts) >= 8
    assert len({len(p.text.encode()) for p in prompts}) == 1


def test_entry_point_engines_are_loaded_and_their_backends_known(
    clean_registry, tmp_path, monkeypatch
):
    from pytest_fsdp_turbo.cases import known_backends

    (tmp_path / "ep_engines_mod.py").write_text(
        "from pytest_fsdp_turbo_engine.registry import register\n"
        "@register(backend='ep_engine', device='cpu')\n"
        "class FromEntryPoint: pass\n"
    )
    dist = tmp_path / "downstream_rl-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: downstream-rl\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest_fsdp_turbo.engines]\nep_engine = ep_engines_mod\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "ep_engine" in known_backends()  # case files may name it; nothing imported yet
    typo = tmp_path / "ep_engines_typo.py"  # a typo in @register is refused at collection
    typo.write_text((tmp_path / "ep_engines_mod.py").read_text().replace("ep_engine'", "ep_engin'"))
    (dist / "entry_points.txt").write_text(
        "[pytest_fsdp_turbo.engines]\nep_engine = ep_engines_typo\n"
    )
    assert "ep_engin" in known_backends() and "ep_engine" not in known_backends()
    (dist / "entry_points.txt").write_text(
        "[pytest_fsdp_turbo.engines]\nep_engine = ep_engines_mod\n"
    )
    registry.load_engine_plugins()
    assert registry.lookup("llama", "ep_engine", "cpu").__name__ == "FromEntryPoint"


def test_an_engine_named_only_in_the_ini_is_a_backend_case_files_may_name(tmp_path, monkeypatch):
    """Its backends are read from the module's source: the pytest process imports nothing."""
    import sys

    from pytest_fsdp_turbo.cases import load_cases
    from pytest_fsdp_turbo_contract.errors import ConfigError

    (tmp_path / "ini_engines_mod.py").write_text(
        "import torch  # never imported by the pytest process\n"
        "from pytest_fsdp_turbo_engine.registry import register\n"
        "@register(model_type='qwen3', backend='ini_engine', device=['cpu'])\n"
        "class FromIni: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nid = "c"\nmodel = "tiny-qwen3"\nbackend = "ini_engine"\n')
    (case,) = load_cases(cases, engine_modules=["ini_engines_mod"])
    assert case.backend == "ini_engine" and "ini_engines_mod" not in sys.modules
    monkeypatch.setenv("PYTEST_FSDP_TURBO_ENGINE_MODULES", "ini_engines_mod")  # the variable too
    assert load_cases(cases)[0].backend == "ini_engine"
    monkeypatch.delenv("PYTEST_FSDP_TURBO_ENGINE_MODULES")
    with pytest.raises(ConfigError) as unknown:
        load_cases(cases)
    message = str(unknown.value)
    assert "field 'backend': expected one of fsdp, fsdp_turbo" in message
    assert "got 'ini_engine'" in message and "\n" not in message
    assert "the ini fsdp_turbo_engine_modules or PYTEST_FSDP_TURBO_ENGINE_MODULES" in message


def test_a_backend_no_engine_module_registers_is_refused_before_any_rank_starts(ppo_run, tmp_path):
    (tmp_path / "real_engines.py").write_text(
        "import torch\nfrom pytest_fsdp_turbo_engine.registry import register\n"
        "@register(backend='real', device=['cpu'])\nclass Real: ...\n"
    )
    with pytest.raises(pytest.fail.Exception) as failed:  # a typo: no rank is started for it
        ppo_run(
            "tiny-qwen3-single-rank",
            backend="rael",
            engine_modules=["real_engines"],
            pythonpath=[str(tmp_path)],
        )
    message = str(failed.value)
    assert message.startswith(
        "ppo_run overrides: case 'tiny-qwen3-single-rank': field 'backend': expected one of fsdp, "
        "fsdp_turbo"
    )
    assert ", real, verl:<name> (" in message
    assert "engine modules read: real_engines); got 'rael'" in message
    assert "\n" not in message


def test_an_engine_module_no_rank_could_import_is_refused_before_launch(ppo_run, tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        ppo_run(
            "tiny-qwen3-single-rank", engine_modules=["no_such_engines"], pythonpath=[str(tmp_path)]
        )
    message = str(failed.value)
    assert message == (
        f"case tiny-qwen3-single-rank: engine module 'no_such_engines': expected a module the "
        f"ranks can import; no source for it on the pythonpath given ({tmp_path}) and this "
        "process's path"
    )


def test_a_backend_only_the_ranks_can_refuse_is_reported_once_with_the_cases_device(
    ppo_run, tmp_path
):
    """A module whose @register names its backend through a variable: the plugin cannot read the
    name, so the ranks' registry decides; its error is shown once, not once per rank."""
    from pytest_fsdp_turbo.report import summary_row

    refused = tmp_path / "refused"
    refused.mkdir()
    # Both ranks refuse; the supervisor stops the peers of the first rank that exits, so each rank
    # leaves only once both have said why (a rank exits through os._exit, after its error file).
    (tmp_path / "indirect_engines.py").write_text(
        "import os, time\n"
        "from pathlib import Path\n"
        "from pytest_fsdp_turbo_engine.fsdp_engine import FSDPEngineWithLMHead\n"
        "from pytest_fsdp_turbo_engine.registry import register\n"
        "NAME = 'indirect'\n"
        "@register(backend=NAME, device=['cpu'])\n"
        "class Indirect(FSDPEngineWithLMHead): ...\n"
        "_exit, _refused = os._exit, Path(os.environ['REFUSED_DIR'])\n"
        "def _exit_once_both_refused(code):\n"
        "    (_refused / os.environ['RANK']).touch()\n"
        "    deadline = time.monotonic() + 60\n"
        "    while len(list(_refused.iterdir())) < 2 and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    _exit(code)\n"
        "os._exit = _exit_once_both_refused\n"
    )
    result = ppo_run(
        "tiny-qwen3-single-rank",
        world_size=2,
        backend="indirekt",
        engine_modules=["indirect_engines"],
        pythonpath=[str(tmp_path)],
        extra_env={"REFUSED_DIR": str(refused)},
    )
    assert not result.ok
    text = result.failure_text()
    assert text.count("no engine for model_type=") == 1, text
    assert "phase load: RegistryError: as rank" in text
    assert all(rank.error.phase == "load" for rank in result.ranks)
    assert '"device": "cpu"' in summary_row(result)

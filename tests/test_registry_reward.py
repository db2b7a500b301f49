import pytest

from pytest_fsdp_turbo_engine.engines import registry
from pytest_fsdp_turbo_engine.rollout.reward import closeness_reward, load_prompts


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


def test_a_rank_imports_what_the_catalog_names_for_its_backend_and_nothing_else(
    clean_registry, tmp_path, monkeypatch
):
    import sys

    from pytest_fsdp_turbo_contract.engines import EngineCatalog

    for name, backend in (("downstream_engines", "downstream"), ("other_engines", "other")):
        (tmp_path / f"{name}.py").write_text(
            "from pytest_fsdp_turbo_engine.engines.registry import register\n"
            f"@register(backend='{backend}', device='cpu')\n"
            "class Downstream: pass\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog = EngineCatalog.from_ranks(["downstream = downstream_engines", "other = other_engines"])
    registry.load_engines(catalog, "downstream")
    assert registry.lookup("any", "downstream", "cpu").__name__ == "Downstream"
    assert "other_engines" not in sys.modules  # declared for another backend: left alone
    catalog = EngineCatalog.from_ranks(["other_engines"])  # a bare module: imported for any
    registry.load_engines(catalog, "fsdp")
    assert registry.lookup("qwen3", "fsdp", "cpu").__name__ == "FSDPEngineWithLMHead"
    assert registry.lookup("any", "other", "cpu").__name__ == "Downstream"


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


def test_an_entry_point_names_its_backend_and_a_module_that_does_not_register_it_is_named(
    clean_registry, tmp_path, monkeypatch
):
    """The entry point's name is the backend: known at collection, nothing imported; a module
    that registers another name is refused in the rank, naming the entry point."""
    import sys

    from pytest_fsdp_turbo_contract.engines import EngineCatalog, engine_catalog

    (tmp_path / "ep_engines_mod.py").write_text(
        "import torch  # never imported by the pytest process\n"
        "from pytest_fsdp_turbo_engine.engines.registry import register\n"
        "@register(backend='ep_engine', device='cpu')\n"
        "class FromEntryPoint: pass\n"
    )
    typo = tmp_path / "ep_engines_typo.py"
    typo.write_text((tmp_path / "ep_engines_mod.py").read_text().replace("ep_engine'", "ep_engin'"))
    dist = tmp_path / "downstream_rl-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: downstream-rl\nVersion: 1.0\n")
    entry_points = dist / "entry_points.txt"
    entry_points.write_text(
        "[pytest_fsdp_turbo.engines]\nep_engine = ep_engines_mod\n"
        "ep_sp_engine = ep_engines_mod [sp, cuda]\n"  # capabilities ride in the value's brackets
        "ep_attr_engine = ep_engines_mod:register\n"  # an :attr, as entry points often have
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog = engine_catalog()
    assert "ep_engine" in catalog.backends and not catalog.is_open
    assert "ep_attr_engine" in catalog.backends
    declared = catalog.capabilities("ep_sp_engine")
    assert declared.capabilities == ("sp",) and declared.devices == {"cuda"}
    assert "entry point ep_sp_engine: ep_sp_engine = ep_engines_mod [cuda, sp]" in (
        declared.announced_by
    )
    assert "ep_engines_mod" not in sys.modules
    registry.load_engines(EngineCatalog.from_ranks(catalog.for_ranks()), "ep_engine")
    assert registry.lookup("llama", "ep_engine", "cpu").__name__ == "FromEntryPoint"
    entry_points.write_text("[pytest_fsdp_turbo.engines]\nep_engine = ep_engines_typo\n")
    catalog = engine_catalog()
    registry._REGISTRY.pop(("*", "ep_engine", "cpu"))
    with pytest.raises(registry.RegistryError) as refused:
        registry.load_engines(EngineCatalog.from_ranks(catalog.for_ranks()), "ep_engine")
    assert str(refused.value).startswith(
        "spec engine_modules declares backend 'ep_engine', but importing ep_engines_typo "
        "registered no engine for it; registered backends: "
    )
    registered = str(refused.value).rpartition("registered backends: ")[2].split(", ")
    assert "ep_engin" in registered  # what the module did register, named


def test_an_engine_declared_in_the_ini_is_a_backend_case_files_may_name(tmp_path, monkeypatch):
    """`BACKEND = MODULE` declares it: the pytest process imports nothing; a bare module opens
    the backends to any plain name, which its ranks judge."""
    import sys

    from pytest_fsdp_turbo.cases import load_cases
    from pytest_fsdp_turbo.options import RETIRED_ENV
    from pytest_fsdp_turbo_contract.engines import GIVEN, INI, engine_catalog
    from pytest_fsdp_turbo_contract.errors import ConfigError
    from pytest_fsdp_turbo_contract.vocab import Env

    (tmp_path / "ini_engines_mod.py").write_text(
        "import torch  # never imported by the pytest process\n"
        "from pytest_fsdp_turbo_engine.engines.registry import register\n"
        "@register(model_type='qwen3', backend='ini_engine', device=['cpu'])\n"
        "class FromIni: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nid = "c"\nmodel = "tiny-qwen3"\nbackend = "ini_engine"\n')
    declared = engine_catalog([(INI, ["ini_engine = ini_engines_mod"])])
    (case,) = load_cases(cases, engines=declared)
    assert case.engine.backend == "ini_engine" and "ini_engines_mod" not in sys.modules
    given = (GIVEN, ["ini_engine=ini_engines_mod"])  # ppo_run's engine_modules
    assert load_cases(cases, engines=engine_catalog([given]))[0].engine.backend == "ini_engine"
    twice = engine_catalog([(INI, ["ini_engine = ini_engines_mod"]), given])
    (entry,) = [e for e in twice.entries if e.module == "ini_engines_mod"]  # announced once
    assert entry.where == INI  # by its first announcement
    bare = engine_catalog([(INI, ["ini_engines_mod"])])
    assert load_cases(cases, engines=bare)[0].engine.backend == "ini_engine"
    with pytest.raises(ConfigError) as unknown:
        load_cases(cases, engines=engine_catalog())
    message = str(unknown.value)
    assert "field 'backend': expected one of fsdp, fsdp_turbo" in message
    assert "got 'ini_engine'" in message and "\n" not in message
    assert "pytest_fsdp_turbo.engines entry points or the ini fsdp_turbo_engine_modules;" in message
    assert Env.ENGINE_MODULES not in message and Env.ENGINE_MODULES in RETIRED_ENV  # refused
    with pytest.raises(ConfigError) as malformed:
        engine_catalog([(INI, ["my engines = x"])])
    assert str(malformed.value) == (
        "ini fsdp_turbo_engine_modules: expected MODULE or BACKEND = MODULE [CAPABILITY, ...] (a "
        "dotted module name; a backend of letters, digits and '_', or verl:<name>; capabilities "
        "among sp, turbo_config, packing, always_packs, own_loop, guards_idle_units, cpu, cuda, "
        "npu); got 'my engines = x'"
    )


def test_a_backend_no_engine_module_registers_is_refused_before_any_rank_starts(ppo_run, tmp_path):
    (tmp_path / "real_engines.py").write_text(
        "import torch\nfrom pytest_fsdp_turbo_engine.engines.registry import register\n"
        "@register(backend='real', device=['cpu'])\nclass Real: ...\n"
    )
    with pytest.raises(pytest.fail.Exception) as failed:  # a typo: no rank is started for it
        ppo_run(
            "tiny-qwen3-single-rank",
            backend="rael",
            engine_modules=["real = real_engines"],
            pythonpath=[str(tmp_path)],
        )
    message = str(failed.value)
    assert message.startswith(
        "ppo_run overrides: case 'tiny-qwen3-single-rank': field 'backend': expected one of fsdp, "
        "fsdp_turbo"
    )
    assert ", real, verl:<name> (" in message
    assert "ppo_run engine_modules: real = real_engines); got 'rael'" in message
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
    """A bare engine module (no `BACKEND = MODULE`): the plugin cannot know what it registers,
    so the ranks' registry decides; its error is shown once, not once per rank."""
    from pytest_fsdp_turbo.report import summary_row

    refused = tmp_path / "refused"
    refused.mkdir()
    # Both ranks refuse; the supervisor stops the peers of the first rank that exits, so each rank
    # leaves only once both have said why (a rank exits through os._exit, after its error file).
    (tmp_path / "indirect_engines.py").write_text(
        "import os, time\n"
        "from pathlib import Path\n"
        "from pytest_fsdp_turbo_engine.engines.fsdp2 import FSDPEngineWithLMHead\n"
        "from pytest_fsdp_turbo_engine.engines.registry import register\n"
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


def test_what_a_case_asks_of_its_engine_is_read_from_the_catalog_entry(tmp_path):
    """Capabilities live on the entry: an engine under any name (a verl subclass included) takes
    SP, packing and a turbo_config when its entry declares them, and only then; the device kinds
    it names bound the case's devices; entry points carry them in their value's brackets."""
    from pytest_fsdp_turbo.cases import load_cases
    from pytest_fsdp_turbo_contract.engines import INI, EngineEntry, engine_catalog
    from pytest_fsdp_turbo_contract.errors import ConfigError

    cases = tmp_path / "cases.toml"
    sp_case = (
        '[[case]]\nid = "c"\nmodel = "tiny-qwen3_5"\nbackend = "{backend}"\nworld_size = 4\n'
        'sp_size = 2\nnum_prompts = 2\ndevices = ["cpu", "npu"]\n'
        "[case.turbo_config.distributed.fsdp_plan]\nreduce_dtype = 'fp32'\n"
    )
    subclass = "verl:acme_turbo = acme.engine [sp, turbo_config, own_loop, always_packs]"
    declared = engine_catalog([(INI, [subclass])])
    cases.write_text(sp_case.format(backend="verl:acme_turbo"))
    (case,) = load_cases(cases, engines=declared)
    assert case.is_turbo and case.capabilities.capabilities == (
        "always_packs",
        "own_loop",
        "sp",
        "turbo_config",
    )
    assert case.rank_spec("cpu", model_path="m", model_type="qwen3_5").engine.capabilities == (
        case.capabilities.capabilities
    )
    with pytest.raises(ConfigError) as refused:  # no entry declares turbo_config for it
        load_cases(cases, engines=engine_catalog([(INI, ["verl:acme_turbo = acme.engine [sp]"])]))
    assert "field 'turbo_config': expected no table, or the backend's engine to declare " in str(
        refused.value
    )
    assert "ini fsdp_turbo_engine_modules: verl:acme_turbo = acme.engine [sp]" in str(refused.value)
    npu_only = engine_catalog([(INI, ["verl:acme_turbo = acme.engine [sp, turbo_config, npu]"])])
    with pytest.raises(ConfigError, match=r"field 'devices': expected device kinds the engine "):
        load_cases(cases, engines=npu_only)
    plain = engine_catalog([(INI, ["mine = mine.engine [packing]"])])
    cases.write_text(sp_case.format(backend="mine"))
    with pytest.raises(ConfigError, match=r"field 'sp_size': expected 1, or the backend's engine"):
        load_cases(cases, engines=plain)
    with pytest.raises(ConfigError, match=r"capabilities among sp, turbo_config"):
        EngineEntry.parse("mine = mine.engine [warp_drive]", "ini")
    with pytest.raises(ConfigError, match=r"expected MODULE or BACKEND = MODULE"):
        EngineEntry.parse("mine.engine [sp]", "ini")  # a bare module declares no backend
    listed = engine_catalog([(INI, ["mine = mine.engine [sp, packing]", "other.mod"])])
    assert listed.capabilities("mine").capabilities == ("packing", "sp") and listed.is_open
    widened = engine_catalog([(INI, ["fsdp_turbo = extra.engine [npu]"])])
    assert widened.capabilities("fsdp_turbo").devices == {"cpu", "cuda", "npu"}  # built-in: all
    devices_only = engine_catalog([(INI, ["verl:acme = acme.engine [cuda]"])])
    assert {"own_loop", "always_packs"} <= set(devices_only.capabilities("verl:acme").capabilities)
    entry = EngineEntry.parse("verl:acme_turbo=acme.engine[turbo_config,sp]", "entry point x")
    assert entry.text == "verl:acme_turbo = acme.engine [sp, turbo_config]"
    assert EngineEntry.parse(entry.text, "spec") == EngineEntry(
        "acme.engine", "verl:acme_turbo", "spec", entry.declares
    )


def test_finding_an_engine_module_imports_nothing_of_its_package(tmp_path):
    """The pytest process looks for an engine module's source without running its package's
    `__init__.py` (engines are imported only in the ranks): a package that would write a file
    when imported writes none, and its module is still found."""
    import sys

    from pytest_fsdp_turbo.cases import engine_module_source

    package = tmp_path / "noisy_engines"
    package.mkdir()
    touched = tmp_path / "imported"
    (package / "__init__.py").write_text(f"open({str(touched)!r}, 'w').close()\n")
    (package / "mod.py").write_text("")
    found = engine_module_source("noisy_engines.mod", [str(tmp_path)])
    assert found == package / "mod.py"
    assert not touched.exists() and "noisy_engines" not in sys.modules
    assert engine_module_source("noisy_engines.absent", [str(tmp_path)]) is None
    assert engine_module_source("pytest_fsdp_turbo_engine.engines.fsdp2") is not None


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("pythonpath", "str"),
        ("engine_modules", "str"),
        ("pythonpath", [1]),
        ("extra_env", {"X": 1}),
    ],
)
def test_ppo_run_options_of_the_wrong_shape_are_one_line(ppo_run, option, value):
    """A string where a list is expected would be read character by character (a module 'p');
    an environment value that is not a string fails in the forked rank. Both are refused before
    any rank starts."""
    with pytest.raises(pytest.fail.Exception) as refused:
        ppo_run("tiny-qwen3-single-rank", **{option: value})
    message = str(refused.value.msg)
    assert message.startswith(f"ppo_run {option}: expected a ")
    assert "\n" not in message

"""The budget page in a real headless Chromium against a real server process.

Starts ``uvicorn api.main:app`` on a free port with a fresh SQLite database, drives the page
with Selenium and checks what it draws against what the API answers. Needs Chromium and
ChromeDriver: ``scripts/install-browser.sh`` installs them (``make test`` runs it first).
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import processes
import pytest
from headroom_process import run_headroom, serve_headroom
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from headroom import planner

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
GPU_BUCKETS = planner.GPU_BUCKETS  # the one vocabulary: code, JSON and page
PHASES = planner.PHASES
WAIT_S = 10.0


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``headroom serve`` on its own SQLite database; yields its base URL."""
    tmp = tmp_path_factory.mktemp("page-server")
    env = {"HEADROOM_DATABASE_URL": f"sqlite:///{tmp}/page.db"}
    with serve_headroom(env, tmp / "server.log", timeout=30) as served:
        yield served.url


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """Headless Chromium at 1280x900."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: run scripts/install-browser.sh to install "
            "Chromium and ChromeDriver for the browser tests"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,900")
    # ChromeDriver as a bound child (tests/processes): it dies with this process, and Chromium
    # with all its helper processes, which carry its tag, is killed at the end however the
    # session ended
    bound, tag = processes.child_options()
    service = Service(str(CHROMEDRIVER), env=bound.pop("env"), popen_kw=bound)
    try:
        driver = webdriver.Chrome(service=service, options=options)
        try:
            # make the viewport itself 1280x900, whatever the window's frame takes
            width, height = driver.execute_script("return [window.innerWidth, window.innerHeight]")
            driver.set_window_size(2 * 1280 - width, 2 * 900 - height)
            yield driver
        finally:
            driver.quit()
    finally:
        processes.end(tag)


@pytest.fixture
def page(server: str, browser: webdriver.Chrome) -> webdriver.Chrome:
    """The page, freshly loaded and drawn for its default model."""
    browser.get(server + "/")
    _wait(browser, lambda d: _peak(d) is not None, "the first estimate is drawn")
    assert _text(browser, "verdict") in ("fits", "does not fit")
    return browser


def _wait(driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], Any], what: str) -> Any:
    try:
        return WebDriverWait(
            driver, WAIT_S, ignored_exceptions=(StaleElementReferenceException,)
        ).until(condition)
    except TimeoutException:
        error = driver.find_element(By.ID, "error").text
        logs = driver.get_log("browser")  # type: ignore[no-untyped-call]
        pytest.fail(f"timed out waiting until {what}; error area: {error!r}; console: {logs}")


def _attr(element: WebElement, name: str) -> str:
    value = element.get_attribute(name)
    assert value is not None, f"no attribute {name!r}"
    return str(value)


def _int(element: WebElement, name: str) -> int:
    return int(_attr(element, name))


def _peak(driver: webdriver.Chrome) -> int | None:
    value = driver.find_element(By.ID, "gpu-bar").get_attribute("data-peak-bytes")
    return int(value) if value else None


def _text(driver: webdriver.Chrome, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text).strip()


def _type(driver: webdriver.Chrome, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _select(driver: webdriver.Chrome, element_id: str, value: str) -> None:
    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def _peak_change(driver: webdriver.Chrome, before: int, what: str) -> int:
    after: int = _wait(
        driver, lambda d: (p := _peak(d)) is not None and p != before and p, f"{what} redraws"
    )
    return after


def test_page_draws_the_budget_and_follows_the_options(page: webdriver.Chrome, server: str) -> None:
    # the default is llama-3-8b on an H200 with the planner's default training spec
    assert Select(page.find_element(By.ID, "model")).first_selected_option.get_attribute(
        "value"
    ) == ("llama-3-8b")
    status, expected = _post(
        server, "/api/v1/estimate", {"model": "llama-3-8b", "gpu": "H200-141GB"}
    )
    assert status == 200
    bar = page.find_element(By.ID, "gpu-bar")
    assert _peak(page) == expected["gpu"]["peak_bytes"]
    assert _int(bar, "data-capacity-bytes") == expected["gpu"]["capacity_bytes"]
    assert _text(page, "verdict") == ("fits" if expected["fits"] else "does not fit")
    assert _text(page, "peak-phase") == expected["peak_phase"]
    assert _text(page, "gpu-peak") == f"{expected['gpu']['peak_bytes'] / 2**30:,.2f} GiB"

    segments = bar.find_elements(By.CSS_SELECTOR, ".segment")
    drawn = [s.get_attribute("data-bucket") for s in segments]
    assert drawn and set(drawn) <= set(GPU_BUCKETS)
    assert drawn == [b for b in GPU_BUCKETS if expected["gpu"]["buckets"][b] > 0]
    assert sum(_int(s, "data-bytes") for s in segments) == _peak(page)
    assert bar.find_element(By.CSS_SELECTOR, ".capacity-line").is_displayed()
    legend = page.find_elements(By.CSS_SELECTOR, "#gpu-legend [data-bucket]")
    assert [li.get_attribute("data-bucket") for li in legend] == list(GPU_BUCKETS)
    rows = page.find_elements(By.CSS_SELECTOR, "#phases tbody tr")
    assert [r.get_attribute("data-phase") for r in rows] == list(PHASES)
    for row in rows:
        phase = row.get_attribute("data-phase")
        assert _int(row, "data-total-bytes") == (expected["gpu"]["phases"][phase]["total_bytes"])

    # a bigger micro-batch needs more memory
    before = _peak(page)
    assert before is not None
    _type(page, "micro_batch_size", "4")
    bigger = _peak_change(page, before, "micro_batch_size 4")
    assert bigger > before
    assert _text(page, "verdict") == "does not fit"

    # full recompute needs less
    _select(page, "recompute", "full")
    smaller = _peak_change(page, bigger, "recompute full")
    assert smaller < bigger

    # offloading half the optimizer moves memory from the GPU to the host; the page then shows
    # what the API answers for the same request
    status, same = _post(
        server,
        "/api/v1/estimate",
        {
            "model": "llama-3-8b",
            "gpu": "H200-141GB",
            "host_memory": "1TiB",
            "train": {
                "micro_batch_size": 4,
                "recompute": "full",
                "offload": {"mode": "optimizer", "fraction": 0.5},
            },
        },
    )
    assert status == 200
    assert same["host"]["peak_bytes"] > 0
    host_bar = page.find_element(By.ID, "host-bar")
    assert _int(host_bar, "data-peak-bytes") == 0
    assert not page.find_element(By.ID, "offload_fraction").is_enabled()
    _select(page, "offload_mode", "optimizer")
    _type(page, "offload_fraction", "0.5")
    _wait(
        page,
        lambda d: (
            _peak(d) == same["gpu"]["peak_bytes"]
            and _int(d.find_element(By.ID, "host-bar"), "data-peak-bytes")
            == same["host"]["peak_bytes"]
        ),
        "optimizer offload 0.5 is drawn",
    )
    assert same["gpu"]["peak_bytes"] < smaller
    assert _text(page, "verdict") == ("fits" if same["fits"] else "does not fit")
    host_segments = host_bar.find_elements(By.CSS_SELECTOR, ".segment")
    assert host_segments
    assert {s.get_attribute("data-bucket") for s in host_segments} <= set(GPU_BUCKETS)
    assert _int(host_bar, "data-capacity-bytes") == 2**40  # the 1TiB default
    assert page.find_element(By.CSS_SELECTOR, "#host-bar .capacity-line")
    assert _text(page, "error") == ""

    ARTIFACTS.mkdir(exist_ok=True)
    assert page.save_screenshot(str(ARTIFACTS / "budget-page.png"))


def _drawn_as_the_api(page: webdriver.Chrome, server: str, framework: str, zero: int) -> int:
    """The page's peak once it draws what the API answers for llama-3-8b on an H200 with
    transformers' model code over 8 ranks under ``framework`` at ZeRO ``zero``."""
    train = {
        "framework": framework,
        "activation_profile": "hf",
        "parallel": {"dp": 8, "zero_stage": zero},
    }
    status, expected = _post(
        server, "/api/v1/estimate", {"model": "llama-3-8b", "gpu": "H200-141GB", "train": train}
    )
    assert status == 200
    peak = expected["gpu"]["peak_bytes"]
    drawn: int = _wait(page, lambda d: _peak(d) == peak and peak, f"{framework} is drawn")
    assert _text(page, "error") == ""
    return drawn


def test_the_framework_and_model_code_follow_the_api(page: webdriver.Chrome, server: str) -> None:
    """Each framework with transformers' model code: the page fixes what the framework fixes
    (fsdp2: ZeRO-3, no offload; deepspeed: ZeRO 1 and up, no streaming; megatron: its own
    distributed optimizer, ZeRO 0, no streaming) and draws what the API answers."""
    _type(page, "dp", "8")
    _select(page, "activation_profile", "hf")
    _select(page, "offload_mode", "optimizer")
    before = _peak_change(page, -1, "dp 8, hf, optimizer offload")
    zero = page.find_element(By.ID, "zero_stage")
    offload = page.find_element(By.ID, "offload_mode")
    streaming = offload.find_element(By.CSS_SELECTOR, 'option[value="streaming"]')

    _select(page, "framework", "fsdp2")
    assert not zero.is_enabled() and not offload.is_enabled()
    assert Select(zero).first_selected_option.get_attribute("value") == "3"
    assert _drawn_as_the_api(page, server, "fsdp2", 3) != before

    _select(page, "framework", "deepspeed")
    assert zero.is_enabled()
    assert not zero.find_element(By.CSS_SELECTOR, 'option[value="0"]').is_enabled()
    assert not streaming.is_enabled()
    _drawn_as_the_api(page, server, "deepspeed", 3)

    _select(page, "framework", "megatron")
    assert not zero.is_enabled() and not streaming.is_enabled()
    assert Select(zero).first_selected_option.get_attribute("value") == "0"
    _drawn_as_the_api(page, server, "megatron", 0)

    # back to plain data parallelism: the controls are free again
    _select(page, "framework", "none")
    assert zero.is_enabled() and offload.is_enabled() and streaming.is_enabled()
    assert zero.find_element(By.CSS_SELECTOR, 'option[value="0"]').is_enabled()


def test_a_model_too_big_for_the_gpu_does_not_fit(page: webdriver.Chrome) -> None:
    _select(page, "model", "llama-3-70b")
    _select(page, "gpu", "RTX-4090")
    _wait(
        page,
        lambda d: (
            _text(d, "verdict") == "does not fit"
            and "RTX-4090" in _text(d, "gpu-title")
            and "llama-3-70b" in _text(d, "model-params")
        ),
        "llama-3-70b on an RTX-4090 is drawn",
    )
    assert page.find_element(By.ID, "verdict").get_attribute("data-fits") == "false"
    bar = page.find_element(By.ID, "gpu-bar")
    assert "over" in _attr(bar, "class").split()
    assert _int(bar, "data-peak-bytes") > _int(bar, "data-capacity-bytes")
    assert _text(page, "gpu-headroom").startswith("−")


def test_invalid_input_shows_the_servers_detail(page: webdriver.Chrome, server: str) -> None:
    # seq_len 0: the server refuses it with a 422 problem whose detail the page shows
    status, problem = _post(
        server, "/api/v1/estimate", {"model": "llama-3-8b", "train": {"seq_len": 0}}
    )
    assert status == 422
    detail = problem["detail"]
    assert "seq_len" in detail
    _type(page, "seq_len", "0")
    _wait(page, lambda d: detail in _text(d, "error"), "the seq_len problem is shown")
    assert page.find_element(By.ID, "error").is_displayed()
    assert page.find_element(By.ID, "results").get_attribute("data-state") == "error"

    # fixing it clears the error and draws again
    _type(page, "seq_len", "2048")
    _wait(
        page,
        lambda d: (
            not d.find_element(By.ID, "error").is_displayed()
            and d.find_element(By.ID, "results").get_attribute("data-state") == "ok"
        ),
        "the error clears",
    )

    # a pasted model the server cannot read: its detail again
    _select(page, "model", "__custom__")
    assert page.find_element(By.ID, "model_json").is_displayed()
    pasted = {"hidden_size": 4096, "num_layers": 32}
    status, problem = _post(server, "/api/v1/estimate", {"model": pasted})
    assert status == 422
    page.find_element(By.ID, "model_json").send_keys(json.dumps(pasted))
    _wait(page, lambda d: problem["detail"] in _text(d, "error"), "the model problem is shown")

    # text that is not JSON at all is caught before it is sent
    _type(page, "model_json", "{not json")
    _wait(page, lambda d: "not valid JSON" in _text(d, "error"), "the JSON problem is shown")

    # a Hugging Face config.json is read
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    _type(page, "model_json", json.dumps(hf))
    _wait(
        page,
        lambda d: (
            not d.find_element(By.ID, "error").is_displayed()
            and d.find_element(By.ID, "results").get_attribute("data-state") == "ok"
        ),
        "the pasted config.json is estimated",
    )
    assert _text(page, "verdict") in ("fits", "does not fit")


def test_the_api_docs_render_from_this_server(server: str, browser: webdriver.Chrome) -> None:
    """Swagger UI draws every operation with nothing fetched from elsewhere and nothing its
    Content-Security-Policy had to block."""
    browser.get_log("browser")  # type: ignore[no-untyped-call]  # drop earlier pages' entries
    browser.get(server + "/api/v1/docs")
    try:
        WebDriverWait(browser, WAIT_S).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) >= 16
        )
    except TimeoutException:
        logs = browser.get_log("browser")  # type: ignore[no-untyped-call]
        pytest.fail(f"Swagger UI drew no operations; console: {logs}")
    fetched = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert fetched and all(url.startswith(server + "/") for url in fetched), fetched
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[no-untyped-call]
    assert errors == [], errors


def test_the_plan_view_draws_the_chosen_layout_and_runners_up(
    page: webdriver.Chrome, server: str
) -> None:
    _select(page, "model", "llama-3-8b")
    _select(page, "gpu", "H100-80GB")
    _type(page, "seq_len", "4096")
    _type(page, "plan_gpus", "16")
    _type(page, "plan_gpus_per_node", "8")
    _type(page, "plan_global_batch", "64")
    train = {
        "attention": "flash",
        "optimizer": "adamw",
        "ema": "none",
        "framework": "none",
        "activation_profile": "textbook",
    }
    body = {
        "model": "llama-3-8b",
        "gpu": "H100-80GB",
        "train": train,
        "gpus": 16,
        "gpus_per_node": 8,
        "global_batch": 64,
        "seq_len": 4096,
    }
    status, expected = _post(server, "/api/v1/plan", body)
    assert status == 200 and expected["fits"]
    page.find_element(By.ID, "plan-run").click()
    _wait(page, lambda d: d.find_element(By.ID, "plan").get_attribute("data-state") == "ok", "plan")
    rows = page.find_elements(By.CSS_SELECTOR, "#plan-table tbody tr.plan-row")
    assert len(rows) == 1 + len(expected["runners_up"])
    chosen, *others = rows
    assert "chosen" in _attr(chosen, "class")
    assert _int(chosen, "data-peak-bytes") == expected["budget"]["gpu"]["peak_bytes"]
    assert float(_attr(chosen, "data-step-seconds")) == expected["predicted_step_seconds"]
    p = expected["plan"]["parallel"]
    assert f"TP {p['tp']}" in chosen.text and f"DP {p['dp']}" in chosen.text
    # the chosen layout's bar is its buckets; each runner-up's bar its peak against capacity
    segments = chosen.find_elements(By.CSS_SELECTOR, ".segment")
    assert sum(_int(s, "data-bytes") for s in segments) == expected["budget"]["gpu"]["peak_bytes"]
    for row, runner in zip(others, expected["runners_up"], strict=True):
        bar = row.find_element(By.CSS_SELECTOR, ".bar")
        assert _int(bar, "data-peak-bytes") == runner["gpu_peak_bytes"]
        assert _int(bar, "data-capacity-bytes") == expected["budget"]["gpu"]["capacity_bytes"]
    assert f"{expected['candidates_considered']:,}" in _text(page, "plan-summary")
    ARTIFACTS.mkdir(exist_ok=True)
    page.execute_script("document.getElementById('plan').scrollIntoView()")
    assert page.save_screenshot(str(ARTIFACTS / "page-plan.png"))

    # the chosen layout applied to the form: one of its ranks, estimated as the API estimates
    # the plan's spec on a node of 8; the plan still answers the form (the layout is its own)
    assert not page.find_element(By.ID, "plan-stale").is_displayed()
    before = _peak(page)
    chosen.find_element(By.CSS_SELECTOR, "button.apply").click()
    assert page.find_element(By.ID, "dp").get_attribute("value") == str(p["dp"])
    assert page.find_element(By.ID, "tp").get_attribute("value") == str(p["tp"])
    assert page.find_element(By.ID, "pp").get_attribute("value") == str(p["pp"])
    estimate = {"model": "llama-3-8b", "gpu": "H100-80GB", "gpus_per_node": 8}
    drawn = _drawn_as_posted(page, server, {**estimate, "train": expected["plan"]}, "the plan")
    assert drawn == expected["budget"]["gpu"]["peak_bytes"] != before
    assert page.find_element(By.ID, "plan").get_attribute("data-stale") == "false"
    # a model or GPU the plan was not made for: the table is marked stale
    _select(page, "model", "llama-3-70b")
    _wait(page, lambda d: d.find_element(By.ID, "plan-stale").is_displayed(), "stale")
    assert page.find_element(By.ID, "plan").get_attribute("data-stale") == "true"
    _select(page, "model", "llama-3-8b")
    _wait(page, lambda d: not d.find_element(By.ID, "plan-stale").is_displayed(), "fresh again")

    # on a cluster the form names (its network; the form's GPU in its nodes), and on one pasted
    _select(page, "plan_cluster", "DGX-B200")
    _wait(page, lambda d: d.find_element(By.ID, "plan-stale").is_displayed(), "stale")
    page.find_element(By.ID, "plan-run").click()
    status, on_b200 = _post(server, "/api/v1/plan", {**body, "cluster": "DGX-B200"})
    assert status == 200 and on_b200["cluster"] == "DGX-B200"
    _wait(page, lambda d: "(DGX-B200)" in _text(d, "plan-summary"), "the DGX-B200 plan")
    first = page.find_element(By.CSS_SELECTOR, "#plan-table tbody tr.plan-row")
    assert float(_attr(first, "data-step-seconds")) == on_b200["predicted_step_seconds"]
    own = {
        "name": "slow-net",
        "gpu": "H100-80GB",
        "gpus_per_node": 8,
        "intra_node_bytes_per_s": 100e9,
        "inter_node_bytes_per_s": 1e9,
    }
    _select(page, "plan_cluster", "__custom__")
    _type(page, "cluster_json", json.dumps(own))
    page.find_element(By.ID, "plan-run").click()
    _wait(page, lambda d: "(slow-net)" in _text(d, "plan-summary"), "the pasted cluster's plan")
    _select(page, "plan_cluster", "")

    # a GPU no cluster preset holds: the server's 422 detail, no table
    _select(page, "gpu", "RTX-4090")
    page.find_element(By.ID, "plan-run").click()
    _wait(page, lambda d: d.find_element(By.ID, "plan").get_attribute("data-state") == "error", "e")
    assert "no cluster preset has RTX-4090" in _text(page, "plan-error")
    assert not page.find_element(By.ID, "plan-table").is_displayed()


def _drawn_as_posted(page: webdriver.Chrome, server: str, body: dict[str, Any], what: str) -> int:
    """The page's peak once it draws what the API answers for ``body``."""
    status, expected = _post(server, "/api/v1/estimate", body)
    assert status == 200, expected
    peak = expected["gpu"]["peak_bytes"]
    drawn: int = _wait(page, lambda d: _peak(d) == peak and peak, f"{what} is drawn")
    assert _text(page, "error") == ""
    return drawn


def test_every_parallel_degree_and_model_code_reaches_the_api(
    page: webdriver.Chrome, server: str
) -> None:
    """TP, PP with virtual stages, CP, sequence parallelism, EP and GPUs per node, and the
    Megatron-Core and torchtitan model codes, as the CLI takes them: the page draws what the
    API answers for the same spec."""
    _select(page, "model", "llama-3-70b")
    before = _peak_change(page, -1, "llama-3-70b")
    degrees = {"dp": 2, "tp": 2, "pp": 2, "vpp": 2, "cp": 2}
    for field, value in degrees.items():
        _type(page, field, str(value))
    page.find_element(By.ID, "sequence_parallel").click()
    _type(page, "gpus_per_node", "8")
    _select(page, "framework", "megatron")
    _select(page, "activation_profile", "megatron")
    parallel = {**degrees, "sequence_parallel": True, "zero_stage": 0}
    train = {"framework": "megatron", "activation_profile": "megatron", "parallel": parallel}
    body = {"model": "llama-3-70b", "gpu": "H200-141GB", "train": train, "gpus_per_node": 8}
    megatron = _drawn_as_posted(page, server, body, "megatron tp2 pp2 vpp2 cp2 sp")
    assert megatron < before  # a quarter of the model's layers' width and depth per GPU
    # 16 GPUs (2 x 2 x 2 x 2), 8 on a node: eight ranks share the node's host RAM
    assert _text(page, "host-summary").endswith(", 8 ranks share the node")

    _select(page, "framework", "fsdp2")
    _select(page, "activation_profile", "torchtitan")
    train = {**train, "framework": "fsdp2", "activation_profile": "torchtitan"}
    train["parallel"] = {**parallel, "zero_stage": 3}
    _drawn_as_posted(page, server, {**body, "train": train}, "fsdp2 with torchtitan's code")

    _select(page, "framework", "none")
    _select(page, "activation_profile", "textbook")
    _select(page, "model", "mixtral-8x7b")
    for field in ("tp", "pp", "vpp", "cp"):
        _type(page, field, "1")
    page.find_element(By.ID, "sequence_parallel").click()
    _type(page, "ep", "2")
    moe = {"dp": 2, "tp": 1, "pp": 1, "vpp": 1, "cp": 1, "ep": 2, "zero_stage": 3}
    train = {"framework": "none", "activation_profile": "textbook", "parallel": moe}
    _drawn_as_posted(
        page, server, {**body, "model": "mixtral-8x7b", "train": train}, "mixtral with EP 2"
    )


def test_a_custom_gpu_pasted_as_json_is_what_the_page_prices(
    page: webdriver.Chrome, server: str
) -> None:
    """A GPU no preset has (here an 80 GiB card at half an H100's speed), pasted as a GPU file
    holds it: drawn against its own capacity, as the API prices it; bad JSON names the field."""
    gpu = {
        "name": "my-80g",
        "memory_bytes": 80 * 2**30,
        "bf16_flops": 500e12,
        "memory_bandwidth_bytes_per_s": 2e12,
        "host_link": "PCIe Gen4 x16",
        "host_link_bytes_per_s": 32e9,
        "cuda_context_bytes": 2**30,
        "allocator_overhead_fraction": 0.07,
    }
    _select(page, "gpu", "__custom__")
    assert page.find_element(By.ID, "gpu_json").is_displayed()
    _type(page, "gpu_json", "{not json")
    _wait(page, lambda d: "GPU JSON is not valid JSON" in _text(d, "error"), "the JSON error")
    _type(page, "gpu_json", json.dumps(gpu))
    # drawn against the card's own capacity, not a preset's (its peak is the H200's: the
    # buckets do not depend on the card's size)
    _wait(page, lambda d: _text(d, "gpu-capacity") == "of 80.00 GiB", "the custom GPU")
    _drawn_as_posted(page, server, {"model": "llama-3-8b", "gpu": gpu}, "the custom GPU")
    _select(page, "gpu", "H200-141GB")
    assert not page.find_element(By.ID, "gpu_json").is_displayed()


def test_a_spec_that_does_not_fit_offers_what_fits_and_applies_it(
    page: webdriver.Chrome, server: str
) -> None:
    """Llama-3-8B at micro-batch 16 on one H200 does not fit: the page offers the ladder's
    answer (POST /fit) with its runners-up, each with the changes it makes, and Apply sets the
    form to one, which then fits with the peak the API gives for the applied spec."""
    _type(page, "micro_batch_size", "16")
    _wait(page, lambda d: _text(d, "verdict") == "does not fit", "the verdict")
    fit = page.find_element(By.ID, "fit")
    assert fit.is_displayed()
    page.find_element(By.ID, "fit-run").click()
    _wait(page, lambda d: d.find_element(By.ID, "fit").get_attribute("data-state") == "ok", "fit")
    asked = {"model": "llama-3-8b", "gpu": "H200-141GB", "host_memory": "1TiB"}
    status, expected = _post(server, "/api/v1/fit", {**asked, "train": {"micro_batch_size": 16}})
    assert status == 200 and expected["fits"]
    rows = page.find_elements(By.CSS_SELECTOR, "#fit-table tbody tr")
    assert len(rows) == 1 + len(expected["runners_up"])
    assert "chosen" in _attr(rows[0], "class")
    assert int(_attr(rows[0], "data-peak-bytes")) == expected["budget"]["gpu"]["peak_bytes"]
    for row, runner in zip(rows[1:], expected["runners_up"], strict=True):
        assert json.loads(_attr(row, "data-changes")) == runner["changes"]
    # a runner-up that changes more than one key (each set in its own field)
    pick = next(i for i, r in enumerate(expected["runners_up"]) if len(r["changes"]) > 1)
    runner = expected["runners_up"][pick]
    apply = rows[1 + pick].find_element(By.CSS_SELECTOR, "button.apply")
    page.execute_script("arguments[0].scrollIntoView({block: 'center'})", apply)
    size = apply.size
    assert apply.is_displayed() and size["width"] > 0, size
    apply.click()
    train = {"micro_batch_size": 16}
    for key, value in runner["changes"].items():
        if key == "parallel.zero_stage":
            train["parallel"] = {"zero_stage": value}
        else:
            train[key] = value
    status, applied = _post(server, "/api/v1/estimate", {**asked, "train": train})
    assert status == 200 and applied["fits"]
    _wait(page, lambda d: _peak(d) == applied["gpu"]["peak_bytes"], "the applied spec is drawn")
    assert _text(page, "verdict") == "fits" and not fit.is_displayed()


def _downloaded(page: webdriver.Chrome, button: str, folder: Path, name: str) -> Any:
    """Click ``button`` and read the JSON file Chromium saves as ``name`` into ``folder``."""
    page.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(folder)}
    )
    target = folder / name
    target.unlink(missing_ok=True)
    page.find_element(By.ID, button).click()
    _wait(page, lambda d: target.exists() and target.stat().st_size > 0, f"{name} is saved")
    return json.loads(target.read_text())


def test_an_estimate_goes_out_as_a_command_files_and_a_link(
    page: webdriver.Chrome, server: str, tmp_path: Path
) -> None:
    """The form as a CLI command that prints the same peak, as the spec and budget files, and
    as a link that opens the same form."""
    _select(page, "model", "llama-3-70b")
    _select(page, "gpu", "H100-80GB")
    for field, value in (("dp", "8"), ("tp", "4"), ("pp", "2"), ("micro_batch_size", "2")):
        _type(page, field, value)
    _select(page, "recompute", "every")
    _type(page, "recompute_every", "4")
    _select(page, "offload_mode", "optimizer")
    _type(page, "offload_fraction", "0.5")
    _type(page, "gpus_per_node", "8")
    command = "headroom estimate llama-3-70b --gpu H100-80GB"
    _wait(page, lambda d: _text(d, "cli-command").startswith(command), "the command")
    # the command and the budget are drawn from one answer: the answer to the last field typed
    # (gpus_per_node) is the whole form's, and nothing is typed after it
    _wait(
        page,
        lambda d: (
            "--gpus-per-node 8" in (cmd := _text(d, "cli-command")) and "recompute.every_k=4" in cmd
        ),
        "the whole command",
    )
    peak = _peak(page)
    words = shlex.split(_text(page, "cli-command"))
    assert words[:2] == ["headroom", "estimate"]
    proc = run_headroom(*words[1:], "--format", "json", env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gpu"]["peak_bytes"] == peak

    spec = _downloaded(page, "download-spec", tmp_path, "train.json")
    assert spec["parallel"]["tp"] == 4 and spec["recompute"] == {"every_k": 4}
    assert spec["offload"] == {"mode": "optimizer", "fraction": 0.5}
    budget = _downloaded(page, "download-budget", tmp_path, "budget.json")
    assert budget["gpu"]["peak_bytes"] == peak
    # the downloaded spec is a training spec the CLI takes, with the same answer
    again = run_headroom(
        *("estimate", "llama-3-70b", "--gpu", "H100-80GB", "--train", str(tmp_path / "train.json")),
        *("--gpus-per-node", "8", "--host-memory", "1TiB", "--format", "json"),
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["gpu"]["peak_bytes"] == peak

    # the link reopens the same form, and so the same estimate
    link = page.current_url
    assert "#s=" in link
    page.get(server + "/")
    _wait(page, lambda d: _peak(d) not in (None, peak), "a fresh page")
    page.get(link)
    page.refresh()
    _wait(page, lambda d: _peak(d) == peak, "the linked form's estimate")
    assert page.find_element(By.ID, "tp").get_attribute("value") == "4"
    assert page.find_element(By.ID, "recompute_every").get_attribute("value") == "4"
    assert Select(page.find_element(By.ID, "recompute")).first_selected_option.text.startswith(
        "full, in blocks"
    )


def test_the_details_a_newcomer_trips_on(page: webdriver.Chrome) -> None:
    """A refused spec leaves no caption of the last model; each phase says what it is in a
    line of its own; at 420 px (a phone) nothing scrolls sideways."""
    _wait(page, lambda d: _text(d, "model-params").startswith("llama-3-8b: "), "the caption")
    rows = page.find_elements(By.CSS_SELECTOR, "#phases tbody tr")
    hints = {
        _attr(row, "data-phase"): row.find_element(By.CSS_SELECTOR, ".phase-hint").text
        for row in rows
    }
    assert hints["optimizer"] == "the optimizer step" and "first step" in hints["step1_forward"]
    assert all(hints.values()), hints
    _select(page, "model", "__custom__")
    _type(page, "model_json", json.dumps({"hidden_size": 100, "num_layers": 2, "num_heads": 3}))
    _wait(page, lambda d: _text(d, "error") != "", "the refusal")
    assert _text(page, "model-params") == ""
    _select(page, "model", "llama-3-8b")
    _wait(page, lambda d: _text(d, "model-params").startswith("llama-3-8b: "), "the caption")
    size = page.get_window_size()
    try:
        width, _ = page.execute_script("return [window.innerWidth, window.innerHeight]")
        page.set_window_size(420 + size["width"] - width, size["height"])
        _wait(page, lambda d: d.execute_script("return window.innerWidth") == 420, "420 px")
        overflow = page.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth"
        )
        assert overflow <= 0, f"{overflow} px to scroll sideways at 420 px"
    finally:
        page.set_window_size(size["width"], size["height"])


def test_the_verdict_names_what_the_stacks_measured_runs_say(
    browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """Beside the verdict, the stack's trust from its measured runs (the published GPU runs
    loaded as records: ``calibrate ingest --published``), or that it has none."""
    env = {"HEADROOM_DATABASE_URL": f"sqlite:///{tmp_path}/trust.db"}
    loaded = run_headroom("calibrate", "ingest", "--published", env={**os.environ, **env})
    assert loaded.returncode == 0, loaded.stderr
    with serve_headroom(env, tmp_path / "server.log", timeout=30) as served:
        coefficients = json.loads(
            urllib.request.urlopen(served.url + "/api/v1/coefficients").read()
        )
        titan = next(s for s in coefficients if s["profile"] == "torchtitan" and s["id"] is None)
        want = next(
            t for t in titan["trust"] if (t["gpu"], t["framework"]) == ("H100-80GB", "fsdp2")
        )
        browser.get(served.url + "/")
        _wait(browser, lambda d: _peak(d) is not None, "the first estimate is drawn")
        _wait(browser, lambda d: "no measured runs of none/" in _text(d, "trust"), "no runs said")
        _select(browser, "gpu", "H100-80GB")
        _type(browser, "dp", "8")
        _select(browser, "activation_profile", "torchtitan")
        _select(browser, "framework", "fsdp2")
        _wait(browser, lambda d: "H100-80GB, worst" in _text(d, "trust"), "the stack's trust drawn")
        said = _text(browser, "trust")
        assert said.startswith(
            f"calibrated on {want['recent_records']} runs of fsdp2/torchtitan on H100-80GB, worst −"
        ), said
        assert f"margin {round(100 * want['margin_fraction'])} % with calibration" in said

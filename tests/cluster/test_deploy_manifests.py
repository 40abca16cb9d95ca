"""deploy/: the Serve config, the KubeRay RayService (against the CRD schema), the Dockerfile, the dashboard."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from cluster.serve_settings import ServeAppArgs
from cp_router.metrics import METRIC_SPECS, PREFIX, exposed_sample_names

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRD_PATH = REPO.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"
APP_IMPORT_PATH = "cluster.serve_app:app"
DEPLOYMENT_NAMES = {"DSAIngress", "DSAEngine"}
# KubeRay v1.7.0 ray-operator/apis/ray/v1/rayservice_types.go: "Deprecated: This field is not used anymore".
DEPRECATED_RAYSERVICE_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # Ray >= 2.5x: how long `ray start --block` drains on SIGTERM
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=Loader)


def check_serve_config(config: dict) -> tuple[ServeDeploySchema, ServeAppArgs]:
    """The Serve config schema, our app's args schema, and the cross-field rules between them."""
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == APP_IMPORT_PATH
    args = ServeAppArgs.model_validate(app.args)
    deployments = {deployment.name: deployment for deployment in app.deployments}
    assert set(deployments) == DEPLOYMENT_NAMES | ({"DSAPrefill"} if args.pd_disaggregation else set())
    # Serve's own queue in front of the ingress must not fill before the app's 429 limit does.
    assert deployments["DSAIngress"].max_ongoing_requests > args.ingress.max_ongoing_requests
    for options in config["applications"][0]["deployments"]:
        assert not stale_serve_options(options), stale_serve_options(options)
        # args.drain_timeout_s sets every deployment's graceful_shutdown_timeout_s: one number, not two.
        assert "graceful_shutdown_timeout_s" not in options
        if "autoscaling_config" in options:  # a replica's target: the streams of one engine batch, at most
            assert options["autoscaling_config"]["target_ongoing_requests"] <= args.max_num_seqs
    return schema, args


def stale_serve_options(options: dict) -> set[str]:
    """Options of a deployment entry that Serve's schema does not know (it ignores them silently, e.g. the
    removed max_concurrent_queries) or marks [DEPRECATED] (autoscaling_config's smoothing_factor ...)."""
    def stale(keys, model) -> set[str]:
        fields = model.model_fields
        return {key for key in keys if key not in fields or "[DEPRECATED]" in (fields[key].description or "")}

    return stale(options, DeploymentSchema) | stale(options.get("autoscaling_config") or {}, AutoscalingConfig)


def test_serve_config_is_accepted_by_serve_run():
    schema, args = check_serve_config(load_yaml(DEPLOY / "serve_config.yaml"))
    assert schema.http_options.host == "127.0.0.1"  # local default: not exposed beyond this machine
    assert args.device == "cpu" and args.cp_size == 2


def test_serve_config_rejects_unknown_args():
    config = load_yaml(DEPLOY / "serve_config.yaml")
    config["applications"][0]["args"]["cp_sise"] = 4
    with pytest.raises(ValueError, match="cp_sise"):
        check_serve_config(config)


@pytest.fixture(scope="module")
def crd_validator():
    """A validator of the CRD's v1 openAPIV3Schema (OpenAPI v3.0 schemas are close to JSON Schema draft 7)."""
    if not CRD_PATH.is_file():
        pytest.skip(f"KubeRay CRD schema not found at {CRD_PATH}; RayService validation skipped")
    crd = load_yaml(CRD_PATH)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def rayservice():
    return load_yaml(DEPLOY / "kuberay" / "rayservice.yaml")


def test_disaggregated_rayservice_has_a_worker_group_per_kind_of_engine_group(crd_validator):
    from cluster.replica_engine import engine_bundles

    rayservice = load_yaml(DEPLOY / "kuberay" / "rayservice-pd.yaml")
    crd_validator.validate(rayservice)
    _, args = check_serve_config(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    assert args.pd_disaggregation
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for kind, group in (("prefill", groups["prefill"]), ("decode", groups["decode"])):
        group_args = args.group_args(kind)
        params = group["rayStartParams"]
        assert json.loads(json.loads(params["resources"])) == {group_args.node_resource: 1}
        bundles = engine_bundles(group_args)  # the group's placement asks for its pods' resource
        assert bundles[0][group_args.node_resource] == 1 and len(bundles) == 1 + group_args.cp_size
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(params["num-gpus"]) \
            == group_args.cp_size


def test_rayservice_validates_against_the_crd(crd_validator, rayservice):
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    crd_validator.validate(rayservice)


def test_the_crd_check_catches_non_string_ray_start_params(crd_validator, rayservice):
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2
    errors = list(crd_validator.iter_errors(broken))
    assert [list(error.path)[-1] for error in errors] == ["num-gpus"]


def test_rayservice_serve_config_and_cp_group_sizing(rayservice):
    spec = rayservice["spec"]
    assert isinstance(spec["serveConfigV2"], str)
    schema, args = check_serve_config(yaml.safe_load(spec["serveConfigV2"]))
    assert schema.http_options.host == "0.0.0.0" and args.device == "cuda"
    cluster = spec["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert all(isinstance(value, str) for group in groups for value in group["rayStartParams"].values())
    (worker,) = cluster["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == int(worker["rayStartParams"]["num-gpus"]) == args.cp_size
    # One CPU per rank worker, one for the engine replica, one for the ingress.
    assert int(worker["rayStartParams"]["num-cpus"]) >= args.cp_size + 2


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_matches_the_project():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    instructions = dockerfile_instructions()
    arguments = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)
    makefile_torch = re.search(r"torch==([\w.]+)", (REPO / "Makefile").read_text()).group(1)
    assert arguments["TORCH_VERSION"] == makefile_torch
    assert next(arg for kind, arg in instructions if kind == "FROM").startswith("python:")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {arg.split()[0] for kind, arg in instructions if kind == "COPY"}
    assert packages <= copied
    entrypoint = json.loads(next(arg for kind, arg in instructions if kind == "ENTRYPOINT"))
    assert entrypoint[0] in pyproject["project"]["scripts"] and entrypoint[1:] == ["serve"]
    assert any(kind == "RUN" and '".[gpu]"' in arg for kind, arg in instructions)


def test_the_image_pins_the_ray_of_the_manifest_and_has_the_probes_tool(rayservice):
    """KubeRay starts head and workers from this image with `rayVersion`; its default probes run wget."""
    instructions = dockerfile_instructions()
    arguments = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)
    assert arguments["RAY_VERSION"] == rayservice["spec"]["rayClusterConfig"]["rayVersion"]
    runs = [arg for kind, arg in instructions if kind == "RUN"]
    assert any('"ray[serve]==${RAY_VERSION}"' in run for run in runs)
    assert any("apt-get install" in run and " wget" in run for run in runs)


def test_grafana_dashboard_uses_existing_metrics_and_covers_them_all():
    text = (DEPLOY / "grafana" / "dsa-serve-dashboard.json").read_text()
    dashboard = json.loads(text)
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    referenced = set(re.findall(re.escape(PREFIX) + r"[A-Za-z0-9_:]+", text))
    assert referenced <= exposed_sample_names(), referenced - exposed_sample_names()
    used_families = {name for name in METRIC_SPECS if any(PREFIX + name in expr for expr in exprs)}
    assert used_families == set(METRIC_SPECS)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(target["refId"] and target["expr"] for panel in dashboard["panels"] for target in panel["targets"])


def test_app_built_without_a_config_file_admits_more_than_serves_default_five():
    """`dsa-serve serve` builds the app in code: the same caps as serve_config.yaml, not Serve's default 5."""
    from cluster.serve_app import ENGINE_MAX_ONGOING, build_application, validate_args

    args = validate_args({"ingress": {"max_ongoing_requests": 100}})
    ingress = build_application(args)._bound_deployment
    (engine_app,) = ingress.init_args[:1]
    assert ingress.max_ongoing_requests == 200 > args.ingress.max_ongoing_requests
    assert engine_app._bound_deployment.max_ongoing_requests == ENGINE_MAX_ONGOING
    yaml_engine = next(d for d in load_yaml(DEPLOY / "serve_config.yaml")["applications"][0]["deployments"]
                       if d["name"] == "DSAEngine")
    assert yaml_engine["max_ongoing_requests"] == ENGINE_MAX_ONGOING


def test_colocated_placement_is_one_server_deployment_holding_the_cp_group():
    from cluster.replica_engine import engine_bundles
    from cluster.serve_app import SERVER_DEPLOYMENT, build_application, validate_args

    args = validate_args({"engine_placement": "colocated", "cp_size": 3})
    server = build_application(args, engine_replicas=2)._bound_deployment
    assert server.name == SERVER_DEPLOYMENT and server.num_replicas == 2
    assert server.max_ongoing_requests == 2 * args.ingress.max_ongoing_requests
    assert server._replica_config.placement_group_bundles == engine_bundles(args) == [{"CPU": 1}] * 4
    with pytest.raises(ValueError, match="engine_placement"):
        validate_args({"engine_placement": "mixed"})


def test_kv_cache_dtype_from_the_serve_yaml_reaches_the_engine_options():
    from cluster.replica_engine import engine_options
    from cluster.serve_app import validate_args
    from model_workers.checkpoint.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(None)
    assert engine_options(validate_args({"kv_cache_dtype": "fp8_e4m3"}), model_dir).kv_cache_dtype == "fp8_e4m3"
    assert engine_options(validate_args({}), model_dir).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype: Input should be 'auto', 'bfloat16' or 'fp8_e4m3'"):
        validate_args({"kv_cache_dtype": "int8"})


@pytest.mark.parametrize("options", [{"max_concurrent_queries": 8},
                                     {"autoscaling_config": {"target_num_ongoing_requests_per_replica": 8}},
                                     {"autoscaling_config": {"target_ongoing_requests": 8, "smoothing_factor": 1}}])
def test_the_serve_config_check_catches_removed_and_deprecated_options(options):
    config = load_yaml(DEPLOY / "serve_config.yaml")
    engine = config["applications"][0]["deployments"][1]
    if "autoscaling_config" in options:
        del engine["num_replicas"]  # Serve refuses both
    engine.update(options)
    ServeDeploySchema.model_validate(config)  # Serve itself lets them through
    with pytest.raises(AssertionError):
        check_serve_config(config)


def test_rayservice_autoscales_cp_groups_and_their_pods(crd_validator, rayservice):
    spec = rayservice["spec"]
    _, args = check_serve_config(yaml.safe_load(spec["serveConfigV2"]))
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True  # else the worker group's maxReplicas does nothing
    (worker,) = cluster["workerGroupSpecs"]
    engine = next(d for d in yaml.safe_load(spec["serveConfigV2"])["applications"][0]["deployments"]
                  if d["name"] == "DSAEngine")
    scaling = engine["autoscaling_config"]
    assert "num_replicas" not in engine  # Serve refuses both
    assert scaling["target_ongoing_requests"] == args.max_num_seqs  # one engine batch per replica
    assert 1 <= worker["minReplicas"] <= scaling["min_replicas"] <= scaling["max_replicas"] == worker["maxReplicas"]
    assert engine["max_ongoing_requests"] > scaling["target_ongoing_requests"]
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    assert [list(error.path)[-1] for error in crd_validator.iter_errors(broken)] == ["upscalingMode"]


def test_rayservice_drains_on_upgrades_and_pod_terminations(rayservice):
    """Streams get drain_timeout_s everywhere: in a Serve rolling update (graceful_shutdown_timeout_s), on the old
    cluster of a NewCluster upgrade (deletion delay), and in a pod's SIGTERM (Ray drains its node, within the
    grace period)."""
    spec = rayservice["spec"]
    assert not DEPRECATED_RAYSERVICE_FIELDS & set(spec)
    _, args = check_serve_config(yaml.safe_load(spec["serveConfigV2"]))
    assert spec["upgradeStrategy"]["type"] == "NewCluster"
    assert spec["rayClusterDeletionDelaySeconds"] >= args.drain_timeout_s
    cluster = spec["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        drain_s = float(next(env["value"] for env in container["env"] if env["name"] == DRAIN_ENV))
        assert args.drain_timeout_s < drain_s < pod["terminationGracePeriodSeconds"]


def test_drain_timeout_flag_is_every_deployments_graceful_shutdown_timeout():
    from cluster import cli
    from cluster.commands.serve import app_args
    from cluster.serve_app import build_application

    def deployments(app):
        bound = app._bound_deployment
        inner = [arg._bound_deployment for arg in bound.init_args if hasattr(arg, "_bound_deployment")]
        return [bound, *inner]

    for placement in ("separate", "colocated"):
        args = app_args(cli.build_parser().parse_args(["serve", "--drain-timeout-s", "45",
                                                       "--engine-placement", placement]))
        assert args.drain_timeout_s == 45
        built = deployments(build_application(args))
        assert [d._deployment_config.graceful_shutdown_timeout_s for d in built] == [45] * len(built)
        # No num_replicas from code unless asked for, so a config file's autoscaling_config applies as it is.
        assert all("num_replicas" not in d._deployment_config.user_configured_option_names for d in built)
    with pytest.raises(ValueError, match="drain_timeout_s: Input should be greater than 0"):
        app_args(cli.build_parser().parse_args(["serve", "--drain-timeout-s", "0"]))

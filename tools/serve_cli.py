"""``remask serve MODEL``: the application in the foreground from one command line, as ``vllm serve MODEL``.

MODEL is an embedded model (tiny-bd, tiny-mdm), a local HF-format directory or a hub id (org/name,
``engine.models.hub``). The options keep vLLM's spelling where the meaning is the same. The command writes a
serve config (the document ``serve run FILE`` reads: ``proxy_location``, ``http_options`` and one application
whose ``args`` are the ``AppConfig``), starting from ``--config FILE`` when given, and validates it with the
app's own config class; ``--dry-run`` prints it (``serve run`` runs the printed file unchanged), otherwise it
is deployed as ``serve run`` deploys a config file: Ray started here (or ``--address``), Serve's proxy on
``--host``/``--port``, then the app, in the foreground until Ctrl-C or SIGTERM, which shut Serve and Ray
down.
"""

from __future__ import annotations

import copy
import json
import signal
import sys
import time
from pathlib import Path

from engine.argtypes import int_list

IMPORT_PATH = "deployments.builder:build_app"
APP_NAME = "remask"
# what serve_config.yaml holds around the app's args (`make serve`)
BASE_DOC = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": {}}]}
DEFAULT_MAX_TOKENS_LIMIT = 1024  # http.max_tokens_limit's default; below the model's context it shrinks to it


def load_doc(path: str | None) -> dict:
    """The serve config to start from: ``path``'s (it must run Remask's app) or ``BASE_DOC``."""
    if path is None:
        return copy.deepcopy(BASE_DOC)
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not a serve config (not YAML: {exc})") from None
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ValueError(f"{path}: not a serve config (no `applications` list); start from serve_config.yaml")
    ours = [a for a in apps if isinstance(a, dict) and a.get("import_path") == IMPORT_PATH]
    if len(ours) != 1:
        raise ValueError(f"{path}: needs exactly one application with import_path {IMPORT_PATH} (found {len(ours)})")
    ours[0].setdefault("args", {})
    return doc


def _app(doc: dict) -> dict:
    return next(a for a in doc["applications"] if a.get("import_path") == IMPORT_PATH)


def _origins(values: list[str] | None) -> list[str] | None:
    """``--allowed-origins``: vLLM's JSON list (``'["*"]'``), a comma list, or several values."""
    if values is None:
        return None
    out: list[str] = []
    for v in values:
        parsed = json.loads(v) if v.strip().startswith("[") else v.split(",")
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise ValueError(f"--allowed-origins {v!r}: a JSON list of strings, or origins separated by commas")
        out += [o.strip() for o in parsed if o.strip()]
    return out


def pick_device(device: str) -> str:
    """``auto``: cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_doc(args) -> tuple[dict, Path]:
    """The serve config of the command line and the model's local directory (a hub id resolved, downloaded
    into the hub cache if missing). Validated: a ``ValueError`` names what is wrong."""
    from pydantic import ValidationError

    from app.config import AppConfig
    from engine.loading import resolve_model
    from engine.models.hub import is_hub_id
    from engine.models.loader import load_config

    if args.model is None and args.config is None:
        raise ValueError("name a MODEL (an embedded model, a directory or a hub id org/name), or give --config FILE")
    doc = load_doc(args.config)
    app_args = _app(doc)["args"]
    http, engine, res = (app_args.setdefault(k, {}) for k in ("http", "engine", "resources"))
    if args.model is not None:
        engine["model"] = args.model
    engine.setdefault("model", "tiny-bd")
    if args.revision is not None:
        engine["revision"] = args.revision
    options = doc.setdefault("http_options", {})
    if args.host is not None:
        options["host"] = args.host
    if args.port is not None:
        options["port"] = args.port
    if args.tensor_parallel_size is not None:
        res["tp_degrees"] = sorted({d for group in args.tensor_parallel_size for d in group})
    if args.served_model_name is not None:
        http["served_model_name"] = args.served_model_name
    if args.api_key:
        http["api_keys"] = [{"name": f"key-{i + 1}", "key": k} for i, k in enumerate(args.api_key)]
    if args.chat_template is not None:  # a file's text goes into the config: the printed config stands alone
        path = Path(args.chat_template).expanduser()
        http["chat_template"] = path.read_text() if path.is_file() else args.chat_template
    if args.max_model_len is not None:
        http["max_model_len"] = args.max_model_len
    if (origins := _origins(args.allowed_origins)) is not None:
        http["allowed_origins"] = origins
    if getattr(args, "decoding", None) is not None:
        engine["decoding"] = args.decoding
    if getattr(args, "decoding_config", None) is not None:
        try:
            engine["decoding_config"] = json.loads(args.decoding_config)
        except ValueError as exc:
            raise ValueError(f"--decoding-config must be a JSON object: {exc}") from None
    if args.device is not None or "device" not in engine:
        engine["device"] = pick_device(args.device or "auto")
        gpus = res.get("gpus_per_rank", 0)
        res["gpus_per_rank"] = (gpus or 1) if engine["device"].startswith("cuda") else 0
    path = resolve_model(engine["model"], engine.get("revision"))
    if is_hub_id(engine["model"]):
        print(f"remask: {engine['model']} resolved to {path}", file=sys.stderr)
    if args.config is None and "max_tokens_limit" not in http:  # no answer longer than the context
        context = load_config(path).max_position_embeddings
        http["max_tokens_limit"] = min(DEFAULT_MAX_TOKENS_LIMIT, context, args.max_model_len or context)
    try:
        AppConfig.model_validate(app_args)
    except ValidationError as exc:
        raise ValueError(f"the serve config is not valid: {exc}") from None
    if "decoding" in engine or "decoding_config" in engine:  # over the checkpoint's rule, as the engine will
        from engine.loading import engine_rule

        engine_rule(path, engine.get("decoding"), engine.get("decoding_config"))
    return doc, path


def dump(doc: dict) -> str:
    """The serve config as YAML, with a header saying how to run it."""
    import yaml

    return ("# Remask, written by `remask serve --dry-run`; run it with: serve run FILE\n"
            + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))


def _stop(signum, frame):
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's way out: Serve, then Ray, shut down


def serve_foreground(doc: dict, address: str | None) -> int:
    """Deploy ``doc`` as ``serve run FILE`` does and wait; Ctrl-C or SIGTERM shut Serve and Ray down."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(doc)
    signal.signal(signal.SIGTERM, _stop)
    ray.init(address=address, namespace="serve")
    opts = config.http_options
    url = f"http://{opts.host}:{opts.port}{_app(doc).get('route_prefix', '/')}"
    code = 0
    try:
        from ray.serve.context import _get_global_client

        serve.start(proxy_location=config.proxy_location, http_options=opts.model_dump(),
                    grpc_options=gRPCOptions(**config.grpc_options.model_dump()))
        _get_global_client().deploy_apps(config, _blocking=False)
        print(f"remask: deploying {APP_NAME}; it answers on {url} once running (Ctrl-C stops it)", file=sys.stderr)
        code = _wait(serve, url)
    except KeyboardInterrupt:
        print("remask: stopping", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        serve.shutdown()
        ray.shutdown()
    return code


def _wait(serve, url: str) -> int:
    """Block, saying once when the app runs; a failed deployment ends the command (1)."""
    said = False
    while True:
        status = serve.status().applications.get(APP_NAME)
        state = str(getattr(status, "status", ""))
        if state.endswith("RUNNING") and not said:
            print(f"remask: serving on {url}", file=sys.stderr)
            said = True
        if state.endswith("DEPLOY_FAILED"):
            print(f"remask: error: the application failed to deploy: {status.message}", file=sys.stderr)
            return 1
        time.sleep(1.0)


def cmd_serve(args) -> int:
    doc, _ = build_doc(args)
    if args.dry_run:
        print(dump(doc), end="")
        return 0
    return serve_foreground(doc, args.address)


def add_parsers(sub) -> None:
    """Add ``serve`` to the ``remask`` sub-parsers."""
    s = sub.add_parser("serve", help="serve a model in the foreground (an embedded model, a directory or a hub id)",
                       description="Serve MODEL with the Ray Serve application, in the foreground (Ctrl-C stops "
                                   "it); --dry-run prints the equivalent serve config instead.")
    s.add_argument("model", nargs="?", metavar="MODEL",
                   help="tiny-bd | tiny-mdm | a local HF-format directory | a hub id org/name (default with "
                        "--config: the config's engine.model)")
    s.add_argument("--config", metavar="FILE", help="start from this serve config (e.g. serve_config.yaml); the "
                                                    "options below override it")
    s.add_argument("--host", help="the HTTP proxy's address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="the HTTP proxy's port (default 8000)")
    s.add_argument("--tensor-parallel-size", "--tp", type=int_list, nargs="+", metavar="D",
                   help="TP degrees, one Denoiser deployment each (several for the planner: --tp 1 2 4 or 1,2,4)")
    s.add_argument("--served-model-name", help="the name clients pass as `model` (default: MODEL)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="a key clients must send as `Authorization: Bearer KEY` (repeatable)")
    s.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, or a file holding one, for every chat (http.chat_template)")
    s.add_argument("--max-model-len", type=int, metavar="N", help="the longest prompt + answer, in tokens")
    s.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="CORS origins: a JSON list ('[\"*\"]'), a comma list or several values (default: off)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="auto (default unless --config sets engine.device): cuda when torch sees a GPU, with one "
                        "GPU per TP rank; cpu: none")
    s.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
    s.add_argument("--decoding", metavar="NAME",
                   help="the decoding rule of every request that names none (engine.decoding: threshold, "
                        "low_confidence, joint_threshold, entropy_bound, hierarchical, credit, ...; default: the "
                        "checkpoint's, else threshold)")
    s.add_argument("--decoding-config", metavar="JSON",
                   help="the rule's configuration as a JSON object (engine.decoding_config), e.g. "
                        "'{\"edit_threshold\": 0.9}'; without --decoding it configures the checkpoint's rule")
    s.add_argument("--address", help="the Ray cluster to join (as `serve run --address`; default: RAY_ADDRESS, "
                                     "a cluster `ray start` runs here, else a new one; `local`: always new)")
    s.add_argument("--dry-run", action="store_true", help="print the serve config (YAML) and exit; "
                                                          "`serve run FILE` runs it unchanged")
    s.set_defaults(func=cmd_serve)

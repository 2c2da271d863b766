"""`llmserve gateway`: flags for the simple case (`--upstream NAME=URL[,URL...]`), a YAML file for the rest."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from llmserve.gateway.config import BALANCING, APIKey, CacheConfig, load_config, parse_upstream

API_KEY_ENV = "LLMSERVE_GATEWAY_API_KEY"
ADMIN_KEY_ENV = "LLMSERVE_GATEWAY_ADMIN_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file: models and their upstreams, keys, cache, health "
                        "(see llmserve/gateway/config.py); flags given too override it")
    parser.add_argument("--upstream", action="append", default=[], metavar="NAME=URL[,URL...]",
                        help="a model name clients use and the OpenAI-compatible servers that serve it; repeat "
                        "for more models")
    parser.add_argument("--balancing", choices=BALANCING, default=None,
                        help="how a model's replicas share requests (default: least_outstanding)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind (default: %(default)s)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY[:NAMESPACE]",
                        help=f"a key callers must send as 'Authorization: Bearer KEY'; keys that name the same "
                        "NAMESPACE share cached answers and limits, a key without one has its own; repeat for more "
                        f"(default: env {API_KEY_ENV}, else open)")
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help=f"the key /dashboard, /metrics and /docs need while API keys are set (default: env "
                        f"{ADMIN_KEY_ENV}; none: those pages are closed)")
    parser.add_argument("--open-admin", action="store_true",
                        help="leave /dashboard, /metrics and /docs open to anyone even while API keys are set")
    cache = parser.add_argument_group("cache")
    cache.add_argument("--redis-url", default=None, help="redis://host:port/db: a cache shared by gateways and kept "
                       "across restarts (default: in this process)")
    cache.add_argument("--no-cache", action="store_true", help="no response cache at all")
    cache.add_argument("--semantic-cache", action="store_true",
                       help="also answer questions that mean the same as a cached one (MiniLM embeddings)")
    cache.add_argument("--semantic-threshold", type=float, default=None,
                       help=f"cosine similarity a semantic hit needs (default: {CacheConfig.semantic_threshold})")
    cache.add_argument("--cache-ttl", type=float, default=None, help=f"seconds (default: {CacheConfig.ttl:g})")
    parser.add_argument("--retries", type=int, default=None,
                        help="other replicas tried after a failure before the first byte (default: 2)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--no-access-log", action="store_true")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        models = {route.name: route for route in (parse_upstream(s, args.balancing) for s in args.upstream)}
        keys = [_key(spec) for spec in args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV)
                                                         else [])]
        cache = {"redis_url": args.redis_url, "ttl": args.cache_ttl, "semantic_threshold": args.semantic_threshold}
        if args.no_cache:
            cache.update(exact=False, semantic=False)
        elif args.semantic_cache:
            cache["semantic"] = True
        config = load_config(args.config, models=models, keys=keys, cache=cache, retries=args.retries,
                             admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
                             open_admin=args.open_admin or None)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from llmserve.gateway.app import create_app

    app = create_app(config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
                log_config=None)
    return 0


def _key(spec: str) -> APIKey:
    key, _, namespace = spec.partition(":")
    if not key:
        raise ValueError(f"--api-key {spec!r}: empty key")
    return APIKey(key=key, namespace=namespace or None)

"""Validated configuration of the Serve application (the builder's argument)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Scaling(BaseModel):
    """Replicas, resources and autoscaling of one deployment."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="autoscaling lower bound")
    max_replicas: int = Field(1, ge=1, description="autoscaling upper bound")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="per-replica load the autoscaler aims at (requests for the "
        "router, open sessions for drafter and target)")
    num_cpus: float = Field(0.25, ge=0, description="CPUs per replica (fractional is fine)")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica")
    accelerator_type: str | None = Field(None, description="e.g. 'L4' (cheap) or 'H100' (large)")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources, e.g. node pools")
    max_ongoing_requests: int = Field(1024, ge=1, description="admission bound per replica")
    max_queued_requests: int = Field(
        1024, ge=1, description="bound on requests Serve queues for this deployment; beyond "
        "it callers get RESOURCE_EXHAUSTED / back-pressure (memory never grows unbounded)")
    target_busy: float = Field(
        0.8, gt=0, le=1, description="drafter and target: the fraction of time a replica's "
        "engine computes that the autoscaler aims at (with target_ongoing_requests: "
        "whichever asks for more replicas); the router ignores it")
    upscale_delay_s: float = Field(5.0, ge=0, description="the load must ask for more "
                                   "replicas this long before they are added")
    downscale_delay_s: float = Field(30.0, ge=0, description="the load must ask for fewer "
                                     "replicas this long before one is removed")
    look_back_period_s: float = Field(10.0, gt=0, description="window the replicas' load "
                                      "signals are averaged over")
    metrics_interval_s: float = Field(2.0, gt=0, description="how often replicas report "
                                      "their load to Serve's controller")
    drain_s: float = Field(
        30.0, ge=0, description="a replica being removed (scale-down, redeploy) takes no new "
        "sessions and has this long to finish the ones it holds; the rest are re-leased by "
        "their routers and rebuilt from the committed tokens (nothing is lost)")

    @model_validator(mode="after")
    def _bounds(self) -> Scaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self

    def bundle(self) -> dict[str, float]:
        """One placement-group bundle holding what one replica (or one TP rank) needs."""
        b: dict[str, float] = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            b["GPU"] = self.num_gpus
        if self.accelerator_type:
            b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return b

    def deployment_options(self, tp_size: int = 1, signal: str | None = None) -> dict:
        """Serve options; ``tp_size`` > 1: a placement group of ``tp_size`` bundles per
        replica (STRICT_PACK: one node), the replica in bundle 0, ranks 1.. in the others.
        ``signal``: the pool's own autoscaling signal (``deployments/autoscaling.py``);
        None: Serve's default (ongoing requests)."""
        actor: dict = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.accelerator_type:
            actor["accelerator_type"] = self.accelerator_type
        if self.resources:
            actor["resources"] = dict(self.resources)
        opts: dict = {"ray_actor_options": actor,
                      "max_ongoing_requests": self.max_ongoing_requests,
                      "max_queued_requests": self.max_queued_requests,
                      "graceful_shutdown_timeout_s": self.drain_s,
                      "graceful_shutdown_wait_loop_s": 0.5}
        if self.min_replicas == self.max_replicas:
            opts["num_replicas"] = self.min_replicas
        else:
            opts["autoscaling_config"] = self.autoscaling_config(signal)
        if tp_size > 1:
            opts["placement_group_bundles"] = [self.bundle() for _ in range(tp_size)]
            opts["placement_group_strategy"] = "STRICT_PACK"
            opts["health_check_period_s"] = 1.0  # a failed group is replaced quickly
        return opts


    def autoscaling_config(self, signal: str | None = None) -> dict:
        """Serve's ``autoscaling_config``: bounds, delays, and the pool's policy."""
        cfg: dict = {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "downscale_to_zero_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        if signal is not None:
            cfg["policy"] = {"policy_function": "deployments.autoscaling:PoolPolicy",
                             "policy_kwargs": {"signal": signal,
                                               "target_busy": self.target_busy}}
        return cfg


class Models(BaseModel):
    """The model pair (aliases such as ``builtin-target`` / ``bench-target`` or local Hugging
    Face checkpoint paths). Their tokenizers must be identical (checked at startup)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field("builtin-target", description="target checkpoint (alias or path)")
    drafter: str | None = Field("builtin-drafter", description="drafter checkpoint; null = "
                                "prompt lookup (ngram) and spec-off only")


class RouterOptions(BaseModel):
    """The Router deployment: the gRPC ingress that runs every request's rounds."""

    model_config = ConfigDict(extra="forbid")

    scaling: Scaling = Field(default_factory=lambda: Scaling(num_cpus=0.2))
    max_concurrent: int = Field(256, ge=1, description="requests per router replica; beyond "
                                "that RESOURCE_EXHAUSTED")
    call_timeout_s: float = Field(30.0, gt=0, description="per-call deadline router->replica")
    target_retries: int = Field(8, ge=0, le=20, description="reconnects to a target replica "
                                "(backoff 0.25 s doubling to 4 s) before UNAVAILABLE")
    drafter_lease_s: float = Field(2.0, gt=0, le=600, description="longest wait for a "
                                   "drafter replica; past it the request runs without "
                                   "speculation (a drafter pool scaled to 0 is starting one)")
    max_prompt_bytes: int = Field(256 << 10, ge=1, le=64 << 20, description="prompt text "
                                  "size limit (UTF-8 bytes), checked before tokenizing; beyond "
                                  "it INVALID_ARGUMENT")
    journal_ttl_s: int = Field(3600, ge=10, le=7 * 86400, description="how long a request's "
                               "journal entry (its committed tokens) is kept for resumes")
    round_log: str | None = Field(None, min_length=1, description="diagnosis: a file on the "
                                  "router's node to append one JSON line per round to (plan, "
                                  "times, the target step's rows and fed positions; "
                                  "bench/round_costs.py reads it); null: off")


_THREADS = ("intra-op torch threads per replica; null: the replica's scaling.num_cpus "
            "(at least 1), so threads follow the CPUs Ray reserves for it (on one shared "
            "machine keep that 1 per process: OpenMP threads that lose their core spin)")


_WAIT = ("longest wait (ms) of a step for the rows of sessions whose replies are out (it "
         "starts as soon as they are all in, at once when none is out; never longer than one "
         "step's compute)")


def _threads(torch_threads: int | None, scaling: Scaling) -> int:
    return torch_threads or max(1, int(scaling.num_cpus))


class DrafterOptions(BaseModel):
    """The Drafter deployment: draft-model and prompt-lookup proposals."""

    model_config = ConfigDict(extra="forbid")

    scaling: Scaling = Field(default_factory=lambda: Scaling(num_cpus=0.3))
    cache_bytes: int = Field(256 << 20, ge=1 << 16, description="KV budget per replica (LRU)")
    max_batch: int = Field(64, ge=1, le=512, description="proposals per drafter step")
    batch_wait_ms: float = Field(50.0, ge=0, le=100, description=_WAIT)
    torch_threads: int | None = Field(None, ge=1, le=256, description=_THREADS)
    session_idle_s: float = Field(10.0, gt=0, le=3600, description="a session with no row "
                                  "waiting and no answer this long is released (a router that "
                                  "died, a client gone); a later call just rebuilds its cache")
    draft_ahead: bool = Field(False, description="while the target verifies, draft the next "
                              "round for 'all drafts accepted, then one of the drafter's likeliest "
                              "next tokens'; a call that matches gets it at once (outputs "
                              "unchanged)")
    draft_ahead_guesses: int = Field(2, ge=1, le=4, description="draft-ahead: the next tokens "
                                     "guessed per greedy row after all drafts accepted (a "
                                     "block drafted for each; from 2 also one per rejection, "
                                     "the runner-up at the rejected draft; a sampled row: its "
                                     "own draw only)")

    def threads(self) -> int:
        return _threads(self.torch_threads, self.scaling)


class TargetOptions(BaseModel):
    """The Target deployment: batched verification, optionally tensor-parallel."""

    model_config = ConfigDict(extra="forbid")

    scaling: Scaling = Field(default_factory=lambda: Scaling(num_cpus=0.5))
    cache_bytes: int = Field(512 << 20, ge=1 << 16, description="KV budget per replica: the "
                             "sessions it holds are served, a new one waits for room")
    admit_wait_s: float = Field(20.0, gt=0, le=3600, description="a row waiting this long for "
                                "KV room evicts the least recently used session outside its "
                                "step (below router.call_timeout_s)")
    max_batch: int = Field(32, ge=1, le=512, description="rows per target forward")
    batch_wait_ms: float = Field(50.0, ge=0, le=100, description=_WAIT)
    torch_threads: int | None = Field(None, ge=1, le=256, description=_THREADS)
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per target "
                         "replica (one placement group of tp_size bundles, STRICT_PACK, each "
                         "with this scaling's CPUs/GPUs); must divide the target's heads")
    prefill_chunk: int | None = Field(64, ge=16, le=1 << 20, description="beside decoding rows, a "
                                      "row with more committed tokens to feed than this (a "
                                      "prefill, a rebuild) feeds this many a step, so an "
                                      "arrival adds at most this to their step (null: the "
                                      "whole prompt in one step)")
    prefill_budget: int | None = Field(None, ge=16, le=1 << 20, description="prefill "
                                       "tokens (rows with more than prefill_chunk to feed) one "
                                       "step feeds at most, all rows together, first come "
                                       "first served: a row past it feeds the rest or waits a "
                                       "step, so a burst's first prompts answer while later "
                                       "ones still prefill; at least prefill_chunk (null: no "
                                       "cap). Off by default: at concurrency 32 on this CPU "
                                       "512 cost spec-off 0.83x its throughput")
    tp_timeout_s: float = Field(30.0, gt=0, le=3600, description="collective timeout of a "
                                "tensor-parallel group: a rank silent this long fails the group")
    tp_heartbeat_s: float = Field(2.0, gt=0, le=60, description="idle tensor-parallel groups "
                                  "exchange a heartbeat this often (a dead rank is noticed)")
    session_idle_s: float = Field(10.0, gt=0, le=3600, description="a session with no row "
                                  "waiting and no answer this long is released (a router that "
                                  "died, a client gone); a later call just rebuilds its cache")
    max_queue: int = Field(1024, ge=1, le=1 << 20, description="verify rows waiting for a "
                           "forward, all streams together; beyond it RESOURCE_EXHAUSTED")
    batch_invariant: bool = Field(True, description="each sampled row's logits computed on "
                                  "its own (bitwise independent of the batch and of padding), "
                                  "so seeded sampling never depends on what else is served; "
                                  "greedy rows share one forward either way; false: one "
                                  "padded forward for the batch (faster, last-bit differences "
                                  "between batch mixes)")

    @model_validator(mode="after")
    def _budget_holds_a_chunk(self) -> TargetOptions:
        if self.prefill_budget is not None and (self.prefill_chunk is None
                                                or self.prefill_budget < self.prefill_chunk):
            raise ValueError(
                f"target.prefill_budget ({self.prefill_budget}) must be at least "
                f"target.prefill_chunk ({self.prefill_chunk}); set it to null without chunks")
        return self

    def threads(self) -> int:
        return _threads(self.torch_threads, self.scaling)


class Security(BaseModel):
    """Who may call, over what, with how much (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    api_keys_file: str | None = Field(
        None, description="API keys ('name: key' lines or a JSON/YAML mapping), read again "
        "when it changes (rotation without a restart); the key's name is the caller")
    api_keys_env: str | None = Field(
        "SPECSERVE_API_KEYS", description="environment variable with more keys "
        "('name:key,...'); null = none")
    require_api_key: bool = Field(
        False, description="refuse to start without any API key configured")
    tls_cert: str | None = Field(None, description="PEM certificate (chain) of the public "
                                 "port; with tls_key, the public port speaks TLS only")
    tls_key: str | None = Field(None, description="PEM private key of the public port")
    data_plane_secret: str | None = Field(
        None, min_length=16, description="shared secret every router -> drafter/target "
        "stream carries; null = a random one per application deployment")
    max_message_bytes: int = Field(4 << 20, ge=1 << 10, le=1 << 30, description="largest "
                                   "public request message (the gRPC proxy refuses more)")
    max_internal_message_bytes: int = Field(32 << 20, ge=1 << 16, le=1 << 30,
                                            description="largest data-plane message")

    @model_validator(mode="after")
    def _tls_pair(self) -> Security:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        return self


class AppConfig(BaseModel):
    """Everything `specserve serve`, a Serve config file or a RayService passes to the
    builder ``deployments.app:build_app``: the model pair, one section per deployment, and
    the shared services."""

    model_config = ConfigDict(extra="forbid")

    models: Models = Field(default_factory=Models)
    router: RouterOptions = Field(default_factory=RouterOptions)
    drafter: DrafterOptions = Field(default_factory=DrafterOptions)
    target: TargetOptions = Field(default_factory=TargetOptions)
    security: Security = Field(default_factory=Security)
    redis_url: str | None = Field(
        None, description="request journal; null = the replica's REDIS_URL environment "
        "variable, and no journal without it")
    bind_host: str | None = Field(
        None, description="address the replicas' data-path gRPC servers bind and advertise; "
        "null = the address of the Ray node the replica runs on (the pod IP on Kubernetes, "
        "127.0.0.x on a local cluster)")
    otlp_endpoint: str | None = Field(
        None, description="OTLP/gRPC endpoint the replicas send traces to, e.g. "
        "'http://collector:4317'; null = the replicas' OTEL_* environment (tracing off "
        "without OTEL_EXPORTER_OTLP_ENDPOINT)")

    @model_validator(mode="after")
    def _admission_before_timeout(self) -> AppConfig:
        if self.target.admit_wait_s >= self.router.call_timeout_s:
            raise ValueError(
                f"target.admit_wait_s ({self.target.admit_wait_s}) must be below "
                f"router.call_timeout_s ({self.router.call_timeout_s}): a row waiting for KV "
                "room that long would time out at the router and be sent again")
        return self

    def journal_url(self) -> str | None:
        """The Redis URL the router's journal uses (``redis_url`` or ``$REDIS_URL``)."""
        import os

        return self.redis_url or os.environ.get("REDIS_URL") or None

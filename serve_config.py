"""``ServeConfig``: everything ``triax serve`` and ``triax generate`` are told, in frozen
sections (the model's source, the layout, the engine and its KV pool, sampling defaults,
HTTP), checked as it is built, naming the flag and the fix. The commands' flags are its
fields (``triax.cli.flags``), and ``inference.build_server`` takes it. JAX-free, below
``inference``: the CLI builds its parser from these fields before JAX may start.

    >>> cfg = ServeConfig.of(model="tiny", mesh="tensor=2", replicas=4)
    >>> cfg.layout.replicas, cfg.engine.slots, cfg.layout.strategy
    (4, 8, 'tp')
    >>> cfg.replace(slots=4).engine.slots
    4
    >>> ServeConfig.of(model="tiny", port=99999)
    Traceback (most recent call last):
    ...
    ValueError: --port 99999: must be in 0..65535; give a free port, e.g. --port 8000 (0: any)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from triax import configs
from triax.choices import (QUANTIZE, SERVE_DTYPE, SERVE_DTYPES, SERVE_STRATEGY, SLOTS,
                           SPECULATIVE, WARMUP, check)
from triax.config_fields import KVPool, shared, spec
from triax.configs import GE0, GE1, GT0, check_fields

# The serving defaults, each in one home: engines, servers and loaders import them.


def _given(flags: dict) -> list[str]:
    """The flags among ``flags`` (name -> value) that are set."""
    return [f"--{k.replace('_', '-')}" for k, on in flags.items() if on]


@dataclass(frozen=True)
class Source:
    """Where the weights come from (exactly one of checkpoint, model, model_dir)."""

    checkpoint: Optional[str] = spec(None, "training checkpoint directory", metavar="DIR")
    model: Optional[str] = shared("model", None)
    model_dir: Optional[str] = spec(None, "Hugging Face model directory (config.json, "
                                          "safetensors, tokenizer.json)", metavar="DIR")
    adapter: tuple[str, ...] = shared("adapter", (), metavar="[NAME=]DIR")
    max_adapters: int = spec(0, "slots of the adapter table (serve: --adapter NAME=DIR and "
                                "POST /v1/load_lora_adapter fill them)",
                             default_help="the named adapters' count")
    max_adapter_rank: int = spec(0, "the table's rank: an adapter of lower rank is padded "
                                    "with zeros", default_help="the named adapters' largest, "
                                                               "else 16")
    adapter_targets: str = spec("", "the table's target modules, comma-separated (an adapter "
                                    "may adapt fewer)",
                                default_help="the named adapters' union, else all seven")
    tokenizer: Optional[str] = shared("tokenizer", None)
    num_layers: Optional[int] = shared("num_layers", None)
    seed: int = shared("seed", 0)

    def __post_init__(self):
        check_fields(self, {"num_layers": (*GE1, "give the layer count, or leave it out")})
        given = _given({"checkpoint": self.checkpoint, "model": self.model,
                                "model_dir": self.model_dir})
        if len(given) > 1:
            raise ValueError(f"give one of --model-dir, --checkpoint, --model (got "
                             f"{' and '.join(given)})")
        if isinstance(self.adapter, str) or self.adapter is None:   # Python callers
            object.__setattr__(self, "adapter", (self.adapter,) if self.adapter else ())
        check_fields(self, {"max_adapters": (*GE0, "give a slot count, e.g. --max-adapters 4"),
                            "max_adapter_rank": (*GE0, "give a rank, e.g. 16")})
        named = self.named_adapters()   # checks the names
        unnamed = [a for a in self.adapter if a not in {f"{n}={d}" for n, d in named}]
        if len(unnamed) > 1 or (unnamed and self.uses_table):
            raise ValueError(f"--adapter {unnamed[-1]}: give one unnamed --adapter DIR (served "
                             f"as the model itself) or named --adapter NAME=DIR ones (beside "
                             f"the base, --max-adapters), not both")
        if self.adapter and self.model_dir is None:
            raise ValueError(f"--adapter {self.adapter[0]!r} adapts a Hugging Face base: give "
                             f"--model-dir BASE_DIR")
        if self.uses_table and self.model_dir is None:
            raise ValueError("--max-adapters: adapters load over a Hugging Face base: give "
                             "--model-dir BASE_DIR")
        loose = [f for f, on in (("--max-adapter-rank", self.max_adapter_rank),
                                 ("--adapter-targets", self.adapter_targets)) if on]
        if loose and not self.uses_table:
            raise ValueError(f"{' and '.join(loose)} shape the adapter table: add --adapter "
                             f"NAME=DIR or --max-adapters N, or drop them")
        if self.max_adapters and self.max_adapters < len(named):
            raise ValueError(f"--max-adapters {self.max_adapters}: {len(named)} adapters are "
                             f"named; give --max-adapters {len(named)} or more")

    @property
    def unnamed_adapter(self) -> Optional[str]:
        """The one ``--adapter DIR`` served as the model itself (None: none)."""
        return None if self.uses_table or not self.adapter else self.adapter[0]

    @property
    def uses_table(self) -> bool:
        """Whether the engines hold a table of adapters picked per request."""
        return bool(self.named_adapters()) or self.max_adapters > 0

    def named_adapters(self) -> list[tuple[str, str]]:
        """``(name, dir)`` of each ``--adapter NAME=DIR``; a name is given once."""
        out: list[tuple[str, str]] = []
        for a in self.adapter:
            name, sep, directory = a.partition("=")
            if not sep or "/" in name or os.sep in name:
                continue   # an unnamed DIR
            if not name or not directory:
                raise ValueError(f"--adapter {a!r}: give NAME=DIR")
            if name in {n for n, _ in out}:
                raise ValueError(f"--adapter {a}: the name {name!r} is given twice")
            out.append((name, directory))
        return out


@dataclass(frozen=True)
class Layout:
    """One replica's mesh (or one per replica), the replicas, and how they are chosen."""

    mesh: str = shared("mesh", "")
    replicas: Optional[int] = spec(None, "split the devices into R replicas (default: as many "
                                         "as hold --mesh, 1 without it; with --plan auto "
                                         "searched)")
    strategy: str = shared("strategy", SERVE_STRATEGY)
    # The prefill's attention across a context axis (docs/long_context.md).
    context_attention: str = shared("context_attention", "all-gather")
    plan: str = shared("plan", "flags")
    objective: str = shared("objective", "throughput")
    device_memory: Optional[str] = shared("device_memory", None)
    dry_run: bool = spec(False, "with --plan auto: print the choice and stop (nothing is "
                                "loaded)")

    def __post_init__(self):
        check_fields(self, {"replicas": (*GE1, "give the replica count, e.g. --replicas 4")})
        if self.device_memory is not None:
            self.device_memory_bytes()
        if self.plan != "auto":
            if self.dry_run:
                raise ValueError("--dry-run reports --plan auto's choice; add --plan auto")
        elif ";" in self.mesh:
            raise ValueError("--plan auto lays every replica out alike: give --mesh as one "
                             "replica's sizes (no ';'), or drop --plan auto")

    def device_memory_bytes(self) -> Optional[int]:
        """``--device-memory`` in bytes (None: not given)."""
        from triax.units import device_memory_bytes
        return device_memory_bytes(self.device_memory)

    def mesh_sizes(self):
        """``--mesh`` as sizes: one replica's dict, or a list with one per replica (``;``);
        ``{"tensor": -1}`` (all of a replica's devices) when not given."""
        from triax.mesh import parse_mesh   # loads JAX: asked only once the devices are set
        if ";" in self.mesh:
            return [parse_mesh(part) for part in self.mesh.split(";") if part.strip()]
        return parse_mesh(self.mesh) or {"tensor": -1}


@dataclass(frozen=True)
class Engine:
    """Each replica's engine: its slots, KV pool, queue and stop tokens."""

    slots: int = spec(SLOTS, "decode slots per replica (each takes KV blocks as its sequence "
                             "grows: with a pool smaller than slots × the longest sequence, "
                             "requests are admitted as blocks are free)")
    pool: KVPool = field(default_factory=KVPool)
    dtype: str = spec(SERVE_DTYPE, "dtype of the served weights and their compute (float32: "
                                   "twice the bytes every decode step reads)",
                      choices=SERVE_DTYPES)
    quantize: str = spec("none", "int8: store the block projections (attention q/k/v/o, the "
                                 "MLP's) as int8 with a scale per output channel, "
                                 "converted to --dtype for each matmul, the scale applied to "
                                 "its product (about half bf16's bytes); embedding, head and "
                                 "norms stay in --dtype; refused on MoE models",
                         choices=QUANTIZE)
    prefix_cache: bool = spec(True, "share the KV blocks of prompts' common first tokens "
                                    "(keyed by a hash of a block's tokens and all before "
                                    "them; kept after use until evicted, least recently used "
                                    "first); a hit skips their prefill")
    max_len: int = spec(0, "KV positions one sequence may hold: a request's prompt plus "
                           "max_tokens (default: the model's context)")
    max_step_tokens: int = spec(0, "tokens one serving step of a replica may spend: each "
                                   "running stream's next token counts one, prompts get the "
                                   "rest, a long one in chunks of whole KV blocks over several "
                                   "steps, so streams keep flowing while it prefills (0: whole "
                                   "prompts at once)")
    max_queue: Optional[int] = spec(None, "requests waiting for a slot at most; more get 429 "
                                          "with Retry-After", default_help="unbounded")
    stop_token: tuple[int, ...] = spec((), "token id that ends a sequence (repeatable; 257 is "
                                           "EOS)")
    speculative: str = spec("off", "speculative decoding: ngram (prompt lookup) or draft (a "
                                   "small model, --draft-model); the target verifies "
                                   "--num-speculative-tokens proposals per step in one pass",
                            choices=SPECULATIVE)
    num_speculative_tokens: int = spec(4, "tokens proposed per row and step (--speculative)")
    draft_model: Optional[str] = spec(None, "the draft of --speculative draft: a preset, a "
                                            "training checkpoint or a Hugging Face directory "
                                            "(the target's vocabulary)", metavar="SOURCE")
    skip_memory_check: bool = spec(False, "load even when a replica's weights and KV cache per "
                                          "device exceed a device's memory "
                                          "($TRIAX_DEVICE_MEMORY sets a device's bytes)")

    def __post_init__(self):
        object.__setattr__(self, "stop_token", tuple(self.stop_token))
        check("dtype", self.dtype, SERVE_DTYPES)
        check("quantize", self.quantize, QUANTIZE)
        check("speculative", self.speculative, SPECULATIVE)
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft needs --draft-model SOURCE, and only it "
                             "takes one")
        check_fields(self, {"slots": (*GE1, "give the decode slots, e.g. --slots 8"),
                            "max_len": (*GE0, "give KV positions, or 0 for the context"),
                            "num_speculative_tokens": (*GE1, "give the proposals per step, "
                                                              "e.g. 4"),
                            "max_step_tokens": (*GE0, "give a step's tokens, e.g. "
                                                      "--max-step-tokens 512, or 0 for whole "
                                                      "prompts"),
                            "max_queue": (*GE0, "give the waiting requests at most, e.g. "
                                                "--max-queue 64")})


@dataclass(frozen=True)
class Sampling:
    """How ``generate`` picks tokens (``serve``'s requests each say their own)."""

    max_new_tokens: Optional[int] = spec(None, "tokens to generate per prompt")
    greedy: bool = spec(False, "argmax decoding (the default)")
    temperature: float = spec(0.0, "sampling temperature (0: greedy)")
    top_k: int = spec(0, "sample from the k likeliest tokens (0: all)")
    top_p: float = spec(1.0, "sample from the likeliest tokens whose probability reaches p "
                             "(1: all)")

    def __post_init__(self):
        check_fields(self, {
            "max_new_tokens": (*GE1, "give the tokens to generate, e.g. --max-new-tokens 16"),
            "temperature": (*GE0, "use 0 for greedy, or e.g. --temperature 0.8"),
            "top_k": (*GE0, "use 0 for no top-k filter, or e.g. --top-k 40"),
            "top_p": ("in (0, 1]", lambda v: 0 < v <= 1, "use 1 for no nucleus filter, or "
                                                          "e.g. --top-p 0.95")})
        if self.greedy and self.temperature:
            raise ValueError("--greedy and --temperature contradict; give one of them")


@dataclass(frozen=True)
class HTTP:
    """Where ``serve`` listens and how long a request may take."""

    host: str = spec("127.0.0.1", "address to listen on (default: 127.0.0.1, this machine only)")
    port: int = spec(8000, "port (0: any free port, printed when ready)")
    request_timeout: float = spec(600.0, "seconds a request may take before it is cancelled "
                                         "with a 408")
    allow_adapter_updates: bool = spec(False, "answer POST /v1/load_lora_adapter and "
                                              "/v1/unload_lora_adapter (a client then names "
                                              "directories the server reads: trusted "
                                              "clients only)")
    compile_cache: Optional[str] = spec(None, "directory of XLA's persistent compilation "
                                              "cache, so a second start compiles nothing "
                                              "('off': none)",
                                        default_help="$JAX_COMPILATION_CACHE_DIR, else "
                                                     "~/.cache/triax/xla", metavar="DIR")
    warmup: str = spec("auto", "which replicas compile every prompt and decode bucket before "
                               "ready: all | first (each layout's first; the rest on first "
                               "use) | auto (first when its programs all came from "
                               "--compile-cache, else all)",
                       choices=WARMUP)
    served_model_name: Optional[str] = spec(None, "the model name requests give",
                                            default_help="--model's preset, or --model-dir's "
                                                         "folder name")
    max_request_bytes: int = spec(16 * 2 ** 20, "a request body's bytes at most; a larger "
                                                 "one gets 413")

    def compile_cache_dir(self) -> Optional[str]:
        """Where compiled programs persist (None: ``--compile-cache off``)."""
        import os
        if self.compile_cache == "off":
            return None
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        return (self.compile_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                or os.path.join(home, "triax", "xla"))

    def __post_init__(self):
        check_fields(self, {
            "port": ("in 0..65535", lambda v: 0 <= v <= 65535, "give a free port, e.g. --port "
                                                               "8000 (0: any)"),
            "request_timeout": (*GT0, "give seconds, e.g. --request-timeout 600"),
            "max_request_bytes": (*GE1, "give bytes, e.g. --max-request-bytes 16777216")})
        check("warmup", self.warmup, WARMUP)


@dataclass(frozen=True)
class ServeConfig:
    """Everything that defines a serving run, in sections; build it flat with ``of``."""

    source: Source = field(default_factory=Source)
    layout: Layout = field(default_factory=Layout)
    engine: Engine = field(default_factory=Engine)
    sampling: Sampling = field(default_factory=Sampling)
    http: HTTP = field(default_factory=HTTP)

    @classmethod
    def of(cls, **flat) -> "ServeConfig":
        """From flat field names (as the flags are named), e.g. ``of(model="tiny", slots=4)``."""
        return configs.from_flat(cls, flat)

    def replace(self, **flat) -> "ServeConfig":
        """A copy with flat fields changed, e.g. ``replace(slots=4)``; checked again."""
        return configs.replace_flat(self, **flat)

    def inert_flags(self, given) -> list[str]:
        """A sentence per flag in ``given`` (field names) that has no effect here: sampling
        filters under greedy decoding, the search's settings without ``--plan auto``."""
        given, lay, out = set(given), self.layout, []
        if self.sampling.temperature == 0:
            out += [f"--{f.replace('_', '-')} has no effect with greedy decoding (give "
                    f"--temperature T > 0 to sample)" for f in ("top_k", "top_p") if f in given]
        if self.engine.speculative == "off" and "num_speculative_tokens" in given:
            out.append("--num-speculative-tokens has no effect without --speculative")
        if lay.plan != "auto" and "objective" in given:
            out.append("--objective has no effect without --plan auto (it ranks the search)")
        if lay.plan != "auto" and self.engine.skip_memory_check and "device_memory" in given:
            out.append("--device-memory has no effect with --skip-memory-check and no "
                       "--plan auto (nothing is checked against it)")
        return out

    def sampling_config(self):
        """The ``SamplingConfig`` requests get by default (``inference.sampling``)."""
        from triax.inference.sampling import SamplingConfig   # loads JAX
        s = self.sampling
        return SamplingConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              seed=self.source.seed, stop_tokens=self.engine.stop_token)

    def to_json(self) -> dict:
        """The config as nested plain values, section by section (JSON-ready)."""
        return dataclasses.asdict(self)

"""Every span attribute key, event name and event attribute key otel-gpu emits.

These names are a stable public contract, documented in docs/attributes.md; a test checks
that every constant here is documented there and every key documented there is here.
A name ending in ``.`` is a prefix: the documented pattern (``otel_gpu.input.<param>.<field>``)
continues it. Hot paths import the names (``from otel_gpu.attributes import X``), so using
one costs a global lookup.
"""

from __future__ import annotations

# --- Instrumentation scopes ---
SCOPE = "otel_gpu"  # the scope of every call's span
SCOPE_REPLAY = "otel_gpu.replay"  # the scope of otel-gpu replay's spans

# --- Code location (semantic conventions), every span at level >= 1 ---
CODE_FUNCTION_NAME = "code.function.name"  # <module>.<qualname> of the decorated function
CODE_FILE_PATH = "code.file.path"  # the file defining the function
CODE_LINE_NUMBER = "code.line.number"  # the line of its def
CODE_STACKTRACE = "code.stacktrace"  # a thread's Python stack (thread_stack events)

# --- Inputs and outputs, level >= 3 ---
INPUT_PREFIX = "otel_gpu.input."  # otel_gpu.input.<param>.<field>
OUTPUT_PREFIX = "otel_gpu.output."  # otel_gpu.output.<key>.<field>
OUTPUT_TYPE = "otel_gpu.output.type"  # class of a returned container cut to max_items
OUTPUT_LENGTH = "otel_gpu.output.length"  # true size of that container

# --- CUDA graphs (devices/cuda_graphs.py), level >= 5 ---
CUDA_GRAPH_CAPTURE = "otel_gpu.cuda_graph.capture"  # true on a call captured into a CUDA graph
CUDA_GRAPH_REPLAY = "otel_gpu.cuda_graph.replay"  # replay number of a captured call's span

# --- Device time (devices/device_time.py) and CUDA faults (devices/cuda_fault.py), level >= 1 ---
DEVICE_DURATION = "otel_gpu.device.duration"  # seconds between the call's two device events
DEVICE_QUEUE_DELAY = "otel_gpu.device.queue_delay"  # seconds from host start to device start
DEVICE_STREAM = "otel_gpu.device.stream"  # id of the stream current when the call started
DEVICE_UNRESOLVED = "otel_gpu.device.unresolved"  # true: events did not complete in the wait
DEVICE_UNMEASURED = "otel_gpu.device.unmeasured_calls"  # calls since the last span: pool empty
CUDA_FAULT = "otel_gpu.cuda.fault"  # kernel | surfaced | candidate
CUDA_FAULT_SUSPECT = "otel_gpu.cuda.fault.suspect"  # span id of the call whose kernel faulted
CUDA_FAULT_CANDIDATES = "otel_gpu.cuda.fault.candidates"  # span ids, when not told apart
CUDA_GRAPH_REPLAY_DEVICE_DURATION = "otel_gpu.cuda_graph.replay.device.duration"  # whole replay

# --- Flags and summaries ---
COMPILED = "otel_gpu.compiled"  # true on a call that ran inside a torch.compile graph
NONFINITE = "otel_gpu.nonfinite"  # true when a tensor of the call held NaN/Inf (level >= 5)
ATTRIBUTES_OMITTED = "otel_gpu.attributes.omitted"  # keys cut by the attribute count limit
EVENTS_OMITTED = "otel_gpu.events.omitted"  # how many events the event count limit cut

# --- Flight recorder, level 10 ---
DUMP_PREFIX = "otel_gpu.dump."  # every otel_gpu.dump.* key below
DUMP_DIR = "otel_gpu.dump.dir"  # absolute path of the call's dump directory
DUMP_SKIPPED = "otel_gpu.dump.skipped"  # why the call was not dumped
DUMP_OUTPUTS_SKIPPED = "otel_gpu.dump.outputs_skipped"  # why not all outputs were dumped
DUMP_OUTPUTS_UNSUPPORTED = "otel_gpu.dump.outputs_unsupported"  # the parts not recorded

# --- Ring, level >= 3 with OTEL_GPU_RING ---
RING_DUMP_DIR = "otel_gpu.ring.dump.dir"  # the ring dump this call triggered

# --- Memory per call (calls/memory.py), level >= 3 where CUDA is initialised ---
MEMORY_PREFIX = "otel_gpu.device.memory."  # every otel_gpu.device.memory.* key below
MEMORY_ALLOCATED_DELTA = "otel_gpu.device.memory.allocated_delta"  # bytes allocated after - before
MEMORY_PEAK = "otel_gpu.device.memory.peak"  # outermost call that raised the high-water mark
MEMORY_RESERVED = "otel_gpu.device.memory.reserved"  # out of memory: allocator's reserved bytes
MEMORY_ALLOCATED = "otel_gpu.device.memory.allocated"  # out of memory: allocated bytes
MEMORY_LARGEST_FREE_BLOCK = "otel_gpu.device.memory.largest_free_block"  # out of memory
MEMORY_DEVICE_FREE = "otel_gpu.device.memory.device_free"  # out of memory: driver's free bytes
MEMORY_DEVICE_TOTAL = "otel_gpu.device.memory.device_total"  # out of memory: the device's size

# --- Modules (instrument_module) ---
MODULE_PREFIX = "otel_gpu.module."  # every otel_gpu.module.* key below
MODULE_CLASS = "otel_gpu.module.class"  # <module>.<qualname> of the submodule's class
MODULE_PATH = "otel_gpu.module.path"  # its path in the model, "" for the root

# --- Recovered spans (otel-gpu recover) ---
RECOVERED = "otel_gpu.recovered"  # true on a span built from a dead process's journal
RECOVERED_INPUTS_TRUNCATED = "otel_gpu.recovered.inputs_truncated"  # journal cut the inputs
RECOVERED_INPUTS_ERROR = "otel_gpu.recovered.inputs_error"  # why the inputs could not be read
THREAD_ID = "thread.id"  # the thread that ran the call (threading.get_ident())
THREAD_NAME = "thread.name"  # a thread's name (thread_stack events)

# --- Stuck-call reports (OTEL_GPU_STUCK_AFTER) ---
STUCK = "otel_gpu.stuck"  # true on a stuck-call report span
STUCK_SPAN_NAME = "otel_gpu.stuck "  # a report span's name: this, then the stuck call's name
STUCK_SECONDS = "otel_gpu.stuck.seconds"  # how long the call had run when reported
STUCK_AFTER = "otel_gpu.stuck.after"  # the OTEL_GPU_STUCK_AFTER threshold
STUCK_CALL = "otel_gpu.stuck.call"  # the stuck call's span name
STUCK_SPAN_ID = "otel_gpu.stuck.span_id"  # the stuck call's span ID, 16 hex digits
STUCK_THREAD = "otel_gpu.stuck.thread"  # thread_stack event: true on the stuck call's thread

# --- Collectives (the torch.distributed target) ---
COLLECTIVE_PREFIX = "otel_gpu.collective."  # every otel_gpu.collective.* key below
COLLECTIVE_OP = "otel_gpu.collective.op"  # all_reduce, broadcast, send, ...
COLLECTIVE_GROUP_NAME = "otel_gpu.collective.group.name"  # the group's description (default_pg)
COLLECTIVE_GROUP_ID = "otel_gpu.collective.group.id"  # torch's unique group_name ("0")
COLLECTIVE_GROUP_RANKS = "otel_gpu.collective.group.ranks"  # the group's global ranks
COLLECTIVE_GROUP_SIZE = "otel_gpu.collective.group.size"  # how many ranks it has
COLLECTIVE_GROUP_RANK = "otel_gpu.collective.group.rank"  # the caller's rank in the group
COLLECTIVE_SEQ = "otel_gpu.collective.seq"  # this process's count of calls on the group, from 1
COLLECTIVE_ASYNC_OP = "otel_gpu.collective.async_op"  # true for async_op=True, isend, irecv
COLLECTIVE_ASYNC_END = "otel_gpu.collective.async_end"  # work_completed or call_returned
COLLECTIVE_PEER = "otel_gpu.collective.peer"  # dst/src of a p2p call or a rooted collective

# --- Snapshots (otel-gpu snapshot) ---
SNAPSHOT = "otel_gpu.snapshot"  # true on a snapshot span
SNAPSHOT_SPAN_NAME = "otel_gpu.snapshot"  # a snapshot span's name
SNAPSHOT_CALLS = "otel_gpu.snapshot.calls"  # how many calls were in flight
SNAPSHOT_REQUESTED_BY = "otel_gpu.snapshot.requested_by"  # pid of the requesting command
CONTROL_SPAN_NAME = "otel_gpu.control"  # a live-control change's span name
CONTROL_SOURCE = "otel_gpu.control.source"  # who asked: "cli pid 123", "opamp", "window", ...
CONTROL_CHANGE = "otel_gpu.control.change"  # what the request set, as JSON
CONTROL_EFFECTIVE = "otel_gpu.control.effective"  # the configuration in force after it, JSON
CONTROL_UNTIL = "otel_gpu.control.until"  # epoch seconds when it lapses; absent: until changed
CONTROL_FUNCTIONS = "otel_gpu.control.functions"  # functions whose level it changed
EVENT_CALL_IN_FLIGHT = "otel_gpu.call_in_flight"  # one per call in flight on a snapshot
CALL_NAME = "otel_gpu.call.name"  # call_in_flight event: the call's span name
CALL_SPAN_ID = "otel_gpu.call.span_id"  # call_in_flight event: its span ID, 16 hex digits
CALL_SECONDS = "otel_gpu.call.seconds"  # call_in_flight event: how long it has run

# --- Replay spans (otel-gpu replay) ---
LINK_KIND = "otel_gpu.link.kind"  # link attribute: "replay_of" on a replay span's link
REPLAY_VERDICT = "otel_gpu.replay.verdict"  # pass, mismatch, error, ...
REPLAY_DUMP_DIR = "otel_gpu.replay.dump.dir"  # the replayed call's dump directory
REPLAY_DETAIL = "otel_gpu.replay.detail"  # the verdict's explanation
REPLAY_OUTPUT = "otel_gpu.replay.output"  # the first output that differs
REPLAY_MAX_ABS_DIFF = "otel_gpu.replay.max_abs_diff"  # its largest absolute difference
REPLAY_MAX_REL_DIFF = "otel_gpu.replay.max_rel_diff"  # its largest relative difference
REPLAY_UNCHECKED = "otel_gpu.replay.unchecked"  # outputs not compared, each with why

# --- Batch steps (otel_gpu.batch: the requests a serving step serves) ---
BATCH_REQUESTS = "otel_gpu.batch.requests"  # how many requests the step serves
BATCH_LINKS = "otel_gpu.batch.links"  # how many links to them the span carries (the cap)
REQUEST_ID = "otel_gpu.request.id"  # link attribute: the request's id, when the engine names it
BATCH_REQUEST_TRACE_IDS = "otel_gpu.batch.request.trace_ids"  # step span: the linked trace ids
BATCH_REQUEST_IDS = "otel_gpu.batch.request.ids"  # step span: the linked requests' ids, if named

# --- Events ---
EVENT_STATS = "otel_gpu.stats"  # one per tensor of the call, level >= 5
EVENT_PARAM_STATS = "otel_gpu.param_stats"  # one per own parameter of a module, first call
EVENT_THREAD_STACK = "otel_gpu.thread_stack"  # one per Python thread on a stuck report
EVENT_EXCEPTION = "exception"  # the semantic-convention exception event
EVENT_SPANS_DROPPED = (
    "otel.sdk.processor.span.processed"  # spans the queue dropped (SDK self-metric name)
)

# --- Attributes of the statistics events ---
STATS_TENSOR = "otel_gpu.tensor"  # input.<key>, output.<key> or param.<name>
STATS_NUMEL = "numel"  # number of elements
STATS_MIN = "min"  # minimum over finite values
STATS_MAX = "max"  # maximum over finite values
STATS_MEAN = "mean"  # mean over finite values
STATS_STD = "std"  # sample standard deviation over finite values
STATS_NAN_COUNT = "nan_count"  # NaN count (floating and complex tensors)
STATS_INF_COUNT = "inf_count"  # Inf count (floating and complex tensors)
# true when NaN/Inf were seen but not counted: the tensor was modified in place before its
# deferred NaN/Inf pass could run (OTEL_GPU_STATS_READ=async)
STATS_NONFINITE_SEEN = "nonfinite"
STATS_FINGERPRINT = "fingerprint"  # 16 hex digits: a 64-bit hash of the tensor's bytes
STATS_AMAX = "amax"  # low precision: the largest finite magnitude
STATS_DYNAMIC_RANGE = "dynamic_range"  # log2(amax / smallest non-zero finite magnitude)
STATS_ZERO_FRACTION = "zero_fraction"  # fraction of values that are zero
STATS_SATURATION = "saturation"  # fraction at the low-precision format's largest magnitude
STATS_UNDERFLOW = "underflow"  # simulated cast: fraction of non-zero values flushed to zero
STATS_OVERFLOW = "overflow"  # simulated cast: fraction beyond the format's largest magnitude
STATS_SIMULATED_FORMAT = "simulated_format"  # the format OTEL_GPU_LOWP_SIMULATE measures against
STATS_NOTE = "otel_gpu.stats.note"  # why a statistic is missing or what it means

# --- Attributes of the exception event ---
EXCEPTION_TYPE = "exception.type"  # the exception's class
EXCEPTION_MESSAGE = "exception.message"  # str(exception), cut to 2048 bytes
EXCEPTION_STACKTRACE = "exception.stacktrace"  # the formatted traceback's end

# --- Attributes of the dropped-spans event ---
ERROR_TYPE = "error.type"  # why spans were dropped: queue_full or export_stalled
COMPONENT_TYPE = "otel.component.type"  # the component that dropped them: otel_gpu_queue
SPANS_DROPPED = "otel_gpu.spans.dropped"  # spans dropped since the last such event
SPANS_DROPPED_TOTAL = "otel_gpu.spans.dropped.total"  # spans dropped since the process started

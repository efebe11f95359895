"""`linnet bench-serving` (also `linnet bench --serving`): many requests at once, against the engine
in-process, over HTTP, or any OpenAI-compatible server (`--url`: vLLM, llama-server, another `linnet serve`).

N requests with prompt lengths drawn from a range (random token ids), a fixed number of new tokens
with end-of-sequence ignored, at most C in flight, optionally arriving as a Poisson process. The
baseline is the same requests one after another through `linnet run`'s generation loop, so the
speed-up is what continuous batching buys. Steady state needs at least ~5x as many requests as
the concurrency; the report says so when a run has fewer. Two shapes exercise prefix caching: a
system prompt shared by every request (`shared_prefix` tokens before each), and chats of `turns`
requests, each turn's prompt the one before, an answer and a new question.

One job per module: `workload` (what is sent), `clients` (how each kind of server is driven and
timed), `result` (the typed rows and summary), `targets` (starting and measuring each target),
`report` (tables and notes), `run` (every target, in interleaved rounds).
"""

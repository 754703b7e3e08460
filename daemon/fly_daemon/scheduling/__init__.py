"""Continuous batching (docs/design.md §3): the scheduler and its rooms.

`scheduler` runs the model thread's loop over `engine_loop`; `request_queue` keeps the books of where each
request is; `preparation` readies prompts and grammars off the model thread; `delivery` turns what the
engine emits into replies; `request_weight` prices a request against a client's admission budget.
"""

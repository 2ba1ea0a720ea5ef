"""OpenAI's Files and Batch API on the queue (docs/batch.md).

- `files`: file records and bytes in Redis (`FileStore`); `file_routes`: /v1/files.
- `store`: batch records, their per-line results and the runners' leases (`BatchStore`).
- `endpoints`: what each batch endpoint does with a line (`LINE_ENDPOINTS`).
- `lines`: an input file's lines, checked; the output and error lines.
- `runner`: the task in every gateway that drives batches (`BatchRunner`); `routes`: /v1/batches.
- `cli`: `pagedq batch run IN.jsonl OUT.jsonl`, straight onto the queue through the SDK.
"""

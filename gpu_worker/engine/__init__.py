"""The synchronous engine (scheduler -> runner -> outputs, one step at a time) and the offline
`LLM` API over it."""

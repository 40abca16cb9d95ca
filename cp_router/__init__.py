"""The router side of dsa-serve: CP math (`cp/`), the engine step loop, scheduler, page allocator and
request state. No model code, no torch.distributed, no Ray."""

"""The fusedserve HTTP service: app factory, batcher, routers, CLI."""

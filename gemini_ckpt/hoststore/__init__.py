"""Ray-side building blocks of the host stores (data-plane transport; actors and client to follow)."""

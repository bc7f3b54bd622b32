"""Environments: the protocol, the leased environment service, and the tasks (`tasks/`)."""

# Load the config package (and with it the root schema, which mounts this package's config)
# before any submodule: `import hybridrl.X.config` as the first import would otherwise meet the
# schema importing it back while it is half-initialised.
import hybridrl.config  # noqa: E402,F401

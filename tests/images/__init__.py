"""The two container images built from the repository's own Dockerfiles, without a Docker daemon.

- ``host``: the Debian tools a daemonless build and run need (buildah, skopeo, umoci, runc,
  mmdebstrap), installed with apt-get on first use.
- ``store``: the cache tree under ``$QUIRE_CACHE_DIR/images`` (buildah's storage, the
  wheelhouse, the exported archives) and the commands that run against it.
- ``base``: the local stand-in for the Dockerfiles' ``python:<version>-slim-<suite>`` base.
- ``wheelhouse``: the wheels pip takes during the build, filled from the host's pip cache.
- ``build``: ``build_image(kind)``: ``buildah bud`` of Dockerfile.<kind>, then an OCI layout
  and a docker-archive tarball.
- ``container``: an exported image unpacked with umoci and run with runc.
- ``python -m tests.images build operator|engine|all``: the same for a person at a shell.

docs/images.md explains the whole and how the stand-in base differs from the official one.
"""

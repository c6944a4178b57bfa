# The project's image: every role of a TFJob runs from it (AIMaster sidecar, PS, workers).
#   docker build -t REGISTRY/deeprec-ext:0.1.0 .
# Workers run your model code: build FROM this image and COPY it in (see
# docs/guide-kubernetes.md), or put it on the data volume.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /app
# dependencies first: a code change does not re-download TensorFlow
COPY setup.py pyproject.toml README.md ./
RUN python - <<'PY' > /tmp/requirements.txt
import ast, pathlib
tree = ast.parse(pathlib.Path("setup.py").read_text())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
reqs = next(k.value for k in call.keywords if k.arg == "install_requires")
print("\n".join(ast.literal_eval(reqs)))
PY
RUN pip install -r /tmp/requirements.txt

COPY deeprec_ext ./deeprec_ext
COPY aimaster ./aimaster
COPY gazer ./gazer
COPY graph_opt ./graph_opt
COPY checkpoint ./checkpoint
COPY tfjob_crd ./tfjob_crd
COPY examples ./examples
RUN pip install --no-deps . \
    && python -c "import deeprec_ext.ps.__main__, aimaster.cli, tfjob_crd.render"

# a fixed numeric non-root user: the manifest's runAsNonRoot / runAsUser check it
RUN useradd --uid 10001 --user-group --home-dir /app --no-create-home deeprec \
    && mkdir -p /var/lib/deeprec && chown 10001:10001 /var/lib/deeprec
USER 10001
# AIMaster gRPC, PS gRPC (the TFJob port)
EXPOSE 50051 2222
ENTRYPOINT []
CMD ["aimaster", "--help"]

# syntax=docker/dockerfile:1
# vllm-router (the routing front of deploy/k8s/router.yaml) from its PyPI package, as a non-root
# user. Build from the repository root (docs/deploy.md):
#   docker build -f deploy/router.Dockerfile -t tierkv-router:0.1.17 .
FROM python:3.12-slim
ARG VLLM_ROUTER_VERSION=0.1.17
RUN pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
    && groupadd --gid 10001 router \
    && useradd --no-create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin router
USER 10001:10001
# 8000: the OpenAI API clients call; 29000: the router's Prometheus metrics
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

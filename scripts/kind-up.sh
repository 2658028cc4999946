#!/usr/bin/env bash
# Bring kvring up on a local kind cluster, end to end: the cluster, the image, the chart (CRD +
# operator), a 3-node CacheCluster with an etcd the operator runs, and the --kv-transfer-config
# vLLM needs.  Needs docker and kind; helm and kubectl come from scripts/setup.sh (.venv/bin) if
# they are not installed.  Not run in CI (no container engine there).
#   scripts/kind-up.sh            # CLUSTER=kvring NAMESPACE=kvring IMAGE=kvring:0.1.0 by default
#   kind delete cluster --name kvring
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-kvring}
NAMESPACE=${NAMESPACE:-kvring}
IMAGE=${IMAGE:-kvring:0.1.0}
export PATH="$PATH:$PWD/.venv/bin"
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is not installed" >&2; exit 1; }
done
kc() { kubectl --context "kind-$CLUSTER" "$@"; }

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

# The image is loaded into the nodes, never pulled: pull policy Never.
helm --kube-context "kind-$CLUSTER" upgrade --install kvring charts/kvring \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
  --wait --timeout 5m
# helm installs a CRD only once; keep it current on re-runs.
kc apply -f crds/cachecluster.yaml
kc wait --for condition=established crd/cacheclusters.kvring.io --timeout 60s

kc -n "$NAMESPACE" apply -f - <<YAML
apiVersion: kvring.io/v1alpha1
kind: CacheCluster
metadata:
  name: kv-cache
spec:
  replicas: 3
  memoryPerNode: 256Mi
  image: $IMAGE
  imagePullPolicy: Never
YAML
kc -n "$NAMESPACE" wait kvc/kv-cache --for condition=Ready --timeout 5m
kc -n "$NAMESPACE" get kvc kv-cache -o wide
echo
echo "vLLM settings (status.connector):"
kc -n "$NAMESPACE" get kvc kv-cache -o jsonpath='{.status.connector}'
echo

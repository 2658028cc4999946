{{/* The chart name, or nameOverride. */}}
{{- define "kvring.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>" (or the release name when it already contains the chart name), or fullnameOverride. */}}
{{- define "kvring.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "kvring.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "kvring.selectorLabels" . }}
{{- end }}

{{- define "kvring.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvring.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvring.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "kvring.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvring.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* Restricted-profile container security context. */}}
{{- define "kvring.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* The operator's rights on namespaced objects: what it does and nothing more.  It reads pods
     but never changes them, and reads no Secrets (pods reference their Secrets themselves). */}}
{{- define "kvring.operatorRules" -}}
# The CacheClusters: read, add/remove the finalizer and kopf's progress annotations.
- apiGroups: [kvring.io]
  resources: [cacheclusters]
  verbs: [get, list, watch, patch, update]
- apiGroups: [kvring.io]
  resources: [cacheclusters/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion on the children need this.
- apiGroups: [kvring.io]
  resources: [cacheclusters/finalizers]
  verbs: [update]
# The children it creates and patches.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, update, delete]
# Each CacheCluster's KV-event stream (<name>-events; deleted again when its spec turns it off).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
# Each CacheCluster's credentials (<name>-tls, <name>-node-token): created once, changed only in
# the steps of a rotation, which keeps the new set in <name>-tls-rotation until it ends.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
# Each CacheCluster's NetworkPolicies (deleted again when its spec turns them off).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
# Node pods: observed for status, never changed.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Events about the handlers' progress and invalid specs.
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
{{/* Cluster-wide rights kopf needs for its own bookkeeping. */}}
{{- define "kvring.clusterRules" -}}
# kopf: notices CRDs and namespaces appearing and going.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}

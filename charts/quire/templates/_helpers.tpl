{{/* Names, labels and small shared values of the chart. */}}

{{/* The release's full name: the release name, or release-chart when it does not contain it. */}}
{{- define "quire.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's Deployment (and its RBAC objects) name. */}}
{{- define "quire.operator.name" -}}
{{- printf "%s-operator" (include "quire.fullname" .) -}}
{{- end -}}

{{- define "quire.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "quire.operator.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object the chart renders. */}}
{{- define "quire.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: quire
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator pods' selector: immutable once the Deployment exists. */}}
{{- define "quire.operator.selectorLabels" -}}
app.kubernetes.io/name: quire-operator
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{/* quire.labels plus the selector labels (instance is in both). */}}
{{- define "quire.operator.labels" -}}
{{ include "quire.labels" . }}
app.kubernetes.io/name: quire-operator
app.kubernetes.io/component: operator
{{- end -}}

{{- define "quire.operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "quire.engine.image" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) -}}
{{- end -}}

{{/* True when the cluster serves the Prometheus Operator's API, or a value forces a monitor. */}}
{{- define "quire.monitoring.render" -}}
{{- $enabled := index . 0 -}}
{{- $kind := index . 1 -}}
{{- $root := index . 2 -}}
{{- if eq (toString $enabled) "auto" -}}
{{- if $root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind) -}}true{{- end -}}
{{- else if $enabled -}}true{{- end -}}
{{- end -}}

{{/* Where engine pods live: the watched namespace, or every namespace. */}}
{{- define "quire.monitoring.namespaceSelector" -}}
{{- if .Values.operator.watchNamespace -}}
matchNames:
  - {{ .Values.operator.watchNamespace | quote }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/* The labels the operator puts on every engine pod and Service (quire_operator.meta). */}}
{{- define "quire.engine.selectorLabels" -}}
app.kubernetes.io/name: quire-engine
app.kubernetes.io/managed-by: quire-operator
{{- end -}}

{{/* The labels the operator puts on every Endpoint Picker pod
(quire_operator.builders.endpoint_picker). */}}
{{- define "quire.endpointPicker.selectorLabels" -}}
app.kubernetes.io/name: quire-endpoint-picker
app.kubernetes.io/managed-by: quire-operator
{{- end -}}

{{/* The name of the engine container's (and Service's) HTTP port, which serves /metrics. */}}
{{- define "quire.engine.portName" -}}
http
{{- end -}}

{{/*
quire.rbac.rules: every API call quire-operator makes on namespaced objects, and nothing more
(a Role in namespaced mode, part of the ClusterRole otherwise). The children's rules follow the
operator's table of kinds (quire_operator/kinds.py), in its order; tests check the two agree.
Children are written by server-side apply: a PATCH, which the API server also authorizes as
create when the object does not exist yet (so patch and create, never update).
Deletion of children is left to the garbage collector (owner references); the operator deletes
only what the spec no longer asks for: an HPA, ScaledObject or PDB, and the routing objects
(InferencePool, the Endpoint Picker's Deployment, Service, ServiceAccount, Role, RoleBinding,
ConfigMap) when routing is turned off.
RBAC lets the operator grant the Endpoint Picker's Role only what it holds itself (no escalate or
bind verbs): it therefore holds what that Role grants (read pods, InferencePools,
InferenceObjectives, InferenceModelRewrites).
*/}}
{{- define "quire.rbac.rules" -}}
# kopf watches InferenceServices and keeps its progress in their annotations (patch); the
# reconciler reads the latest one (get), the periodic resync lists them (list), and the status
# subresource is written (patch).
- apiGroups: [quire.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [quire.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# Children carry a blockOwnerDeletion owner reference to their InferenceService. Where the
# OwnerReferencesPermissionEnforcement admission plugin is on (OpenShift, hardened clusters),
# setting it requires update on the owner's finalizers subresource; the operator sets no
# finalizer itself.
- apiGroups: [quire.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# Children: watched (list, watch) to repair drift, read (get) to make sure an existing object of
# the same name is this InferenceService's before anything is applied, applied (create, patch);
# deleted when no longer wanted (the HPA and PDB; the Endpoint Picker's Deployment and Service
# when routing is turned off).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The model cache (spec.model.cache): its PersistentVolumeClaim, applied, read, watched for its
# phase, deleted when the cache is turned off; its download Job, applied, read and watched for
# its progress (finished Jobs are left to the garbage collector).
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch]
# KEDA ScaledObjects (autoscaling.backend keda): applied, read and deleted when the backend
# switches or autoscaling goes off, and watched (list, watch) for their conditions where KEDA is
# installed when the operator starts (it runs without KEDA too).
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
# Routing (spec.routing.mode InferencePool): the InferencePool, applied, read, deleted when routing
# is turned off, and watched (list, watch) for the Gateways' reports in its status.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
# Multi-node replicas (spec.parallelism.nodes > 1): the LeaderWorkerSet that replaces the
# Deployment, read, applied and deleted when the spec goes back to one node. Not watched: its
# pods are (below), and it runs without the LeaderWorkerSet CRD too.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, create, patch, delete]
# The Endpoint Picker's ServiceAccount, ConfigMap, Role and RoleBinding: read, applied, deleted
# when routing is turned off. Never listed or watched (no reading of every ConfigMap): a change
# to them is repaired on the next reconcile.
- apiGroups: [""]
  resources: [serviceaccounts, configmaps]
  verbs: [get, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
# Held only to be granted to the Endpoint Picker (its Role): GIE's InferenceObjectives and
# InferenceModelRewrites, which the picker reads where they are installed.
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives, inferencemodelrewrites]
  verbs: [get, list, watch]
# Pods: engine and Endpoint Picker pods watched and listed to explain an unready replica in the
# status, download pods for the model cache's outcome (their termination message); never
# changed; get is held for the Endpoint Picker's Role.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- if .Values.rbac.readApiKeySecrets }}
# Secrets: read (get, never listed or watched) only with spec.lora and spec.apiKeySecretRef: the
# API key that the replicas' runtime LoRA endpoints (load, unload) sit behind
# (rbac.readApiKeySecrets). A missing Secret shows in the pods' status, which the operator reads
# from the pods above.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
{{- end }}
# The operator posts one Event per status transition on the InferenceService (and kopf posts
# handler errors).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* kopf peering: quire-operator creates its peering object at start (create), kopf watches it
(list, watch) and patches its replicas' keep-alives into it (patch), and the retry/resync thread
reads it (get) to act only while its replica is the active one. */}}
{{- define "quire.rbac.peeringRules" -}}
# kopf peering: the operator replicas' keep-alives, one active at a time.
- apiGroups: [kopf.dev]
  resources: [{{ . }}]
  verbs: [get, list, watch, create, patch]
{{- end -}}

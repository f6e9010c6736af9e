{{/*
Names, labels and the pieces both DaemonSets share.

Rules:
- fullname: fullnameOverride, else the release's name where it contains the
  chart's name, else <release>-<name>; 63 characters at most.
- Selector labels are `app: <fullname>-<component>` and nothing else: a
  DaemonSet's selector is immutable, so it holds nothing that changes with a
  chart version or a value (and it is what deploy/'s static manifests have
  always used, so a DaemonSet applied from them can be taken over by a
  release without deleting it).
- labels: the selector label, the recommended app.kubernetes.io/ labels and
  helm's own (helm.sh/chart, app.kubernetes.io/managed-by; deploy/'s static
  manifests are this chart's output without those two).
*/}}

{{- define "gpu-isolator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-isolator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The selector labels of a component: (dict "context" $ "component" "kubelet-plugin"). */}}
{{- define "gpu-isolator.selectorLabels" -}}
app: {{ include "gpu-isolator.fullname" .context }}-{{ .component }}
{{- end }}

{{/* Every object's labels: (dict "context" $ "component" "dra-plugin"). */}}
{{- define "gpu-isolator.labels" -}}
{{ include "gpu-isolator.selectorLabels" . }}
app.kubernetes.io/name: {{ include "gpu-isolator.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .context.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: gpu-isolator
helm.sh/chart: {{ printf "%s-%s" .context.Chart.Name .context.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .context.Release.Service }}
{{- end }}

{{- define "gpu-isolator.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "gpu-isolator.credentialSecret" -}}
{{- .Values.credential.secretName | default (printf "%s-credential" (include "gpu-isolator.fullname" .)) }}
{{- end }}

{{- define "gpu-isolator.draServiceAccount" -}}
{{- .Values.serviceAccount.name | default (printf "%s-dra-plugin" (include "gpu-isolator.fullname" .)) }}
{{- end }}

{{/* Whether the pods get --credential (fails where the values contradict each other). */}}
{{- define "gpu-isolator.credential" -}}
{{- if and .Values.credential.enabled (not .Values.metrics.enabled) }}
{{- fail "credential.enabled needs metrics.enabled: the operator's routes that the credential guards are served on the metrics port (--credential needs --listen); set credential.enabled=false too" }}
{{- end }}
{{- if .Values.credential.enabled }}true{{ end }}
{{- end }}

{{/*
The start of both containers' script: NVML from the host's driver directory
(only libnvidia-ml.so.1 on the library path: the image's own libc stays in
use), a loader cache of the driver directory for the driver volume, and the
CDI specs' loader-cache hook installed on a host path (the runtime runs it on
the host). Then `exec gpu-isolator <command> "$@"`: the options are the
container's args, one each.
*/}}
{{- define "gpu-isolator.script" -}}
- >
  mkdir -p /tmp/nvml &&
  ln -sf /host/driver/libnvidia-ml.so.1 /tmp/nvml/ &&
  ldconfig -C /tmp/driver.cache -f /dev/null /host/driver &&
  install -m 0755 "$(python3 -c 'from isolators.cdi import HOOK_FILE; print(HOOK_FILE)')"
  /var/run/gpu-isolator/gpu-isolator-cdi-hook &&
  export LD_LIBRARY_PATH=/tmp/nvml PATH="$PATH:/host/bin" &&
  exec gpu-isolator {{ . }} "$@"
- gpu-isolator-{{ . }}
{{- end }}

{{/* The options both front doors take from the chart's values, after their own. */}}
{{- define "gpu-isolator.commonArgs" -}}
- --cdi_spec_dir=/var/run/cdi
- --dev_dir=/dev
- --volume_dir=/var/run/gpu-isolator/volume
- --ld_cache=/tmp/driver.cache
- --cdi_hook=/var/run/gpu-isolator/gpu-isolator-cdi-hook
{{- if ne .Values.nodeLedger.hostPath "/run/gpu-isolator/ledger" }}
- --node_ledger={{ .Values.nodeLedger.hostPath }}
{{- end }}
{{- end }}

{{/* A sharing front door's MPS options (values.mps). */}}
{{- define "gpu-isolator.mpsArgs" -}}
- --mps_cgroup={{ .Values.mps.cgroup }}
{{- with .Values.mps.control }}
- --mps_control={{ . }}
{{- end }}
{{- end }}

{{/* The scheduling and pod-level fields both DaemonSets share. */}}
{{- define "gpu-isolator.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 0 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- with .Values.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{/* Volumes both DaemonSets mount from the host (and the credential). */}}
{{- define "gpu-isolator.commonVolumeMounts" -}}
- {name: cdi, mountPath: /var/run/cdi}
- {name: dev, mountPath: /dev}
- {name: volume, mountPath: /var/run/gpu-isolator}
- {name: ledger, mountPath: {{ .Values.nodeLedger.hostPath }}}
- {name: driver, mountPath: /host/driver, readOnly: true}
- {name: driver-bin, mountPath: /host/bin, readOnly: true}
{{- if include "gpu-isolator.credential" . }}
- {name: credential, mountPath: /etc/gpu-isolator/credential, subPath: credential, readOnly: true}
{{- end }}
{{- end }}

{{- define "gpu-isolator.commonVolumes" -}}
- {name: cdi, hostPath: {path: /var/run/cdi, type: DirectoryOrCreate}}
- {name: dev, hostPath: {path: /dev}}
- {name: volume, hostPath: {path: /var/run/gpu-isolator, type: DirectoryOrCreate}}
- {name: ledger, hostPath: {path: {{ .Values.nodeLedger.hostPath }}, type: DirectoryOrCreate}}
- {name: driver, hostPath: {path: {{ .Values.hostDriver.libraryDir }}}}
- {name: driver-bin, hostPath: {path: {{ .Values.hostDriver.binDir }}}}
{{- if include "gpu-isolator.credential" . }}
- name: credential
  secret: {secretName: {{ include "gpu-isolator.credentialSecret" . }}, defaultMode: 0600}
{{- end }}
{{- end }}

{{/* The container's listen option and port, where metrics are on. */}}
{{- define "gpu-isolator.listenArgs" -}}
{{- if .context.Values.metrics.enabled }}
- --listen=0.0.0.0:{{ .port }}
{{- if include "gpu-isolator.credential" .context }}
- --credential=/etc/gpu-isolator/credential
{{- end }}
{{- end }}
{{- end }}

{{/* The DaemonSets' comment on the credential's Secret. */}}
{{- define "gpu-isolator.credentialComment" -}}
{{- if include "gpu-isolator.credential" . }}
# The operator's routes (--credential) read the Secret {{ include "gpu-isolator.credentialSecret" . }}, key
# `credential`, mounted by subPath: a root-owned regular file of mode 0600.
{{- if .Values.credential.create }} The
# chart makes it; where this is applied without helm, create it first:
{{- else }} Create
# it first:
{{- end }}
#   kubectl -n {{ .Release.Namespace }} create secret generic {{ include "gpu-isolator.credentialSecret" . }} \
#     --from-literal=credential=$(openssl rand -hex 32)
{{- end }}
{{- end }}

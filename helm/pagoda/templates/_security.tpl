{{/*
TLS and API-key Secrets of a router or worker, mounted read-only under /etc/pagoda/. .mounts is a
list of dicts {name, secret, dir, key}: a whole Secret (no key) or one key of it as the file
<dir>/<name>. "pagoda.secretMounts" renders volumeMounts entries, "pagoda.secretVolumes" volumes.
*/}}
{{- define "pagoda.secretMounts" -}}
{{- range .mounts }}
- name: {{ .name }}
  mountPath: {{ .dir }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pagoda.secretVolumes" -}}
{{- range .mounts }}
- name: {{ .name }}
  secret:
    secretName: {{ .secret }}
    {{- if .key }}
    items:
      - {key: {{ .key | quote }}, path: {{ .name }}}
    {{- end }}
{{- end }}
{{- end -}}

{{/* The Secrets a server's tls/apiKeysSecret values name, as mounts (empty names: none). */}}
{{- define "pagoda.serverSecretMounts" -}}
{{- $m := list -}}
{{- if .tls.secretName -}}
{{- $m = append $m (dict "name" "tls" "secret" .tls.secretName "dir" "/etc/pagoda/tls") -}}
{{- end -}}
{{- if .apiKeysSecret.name -}}
{{- $m = append $m (dict "name" "api-keys" "secret" .apiKeysSecret.name "dir" "/etc/pagoda/api-keys" "key" .apiKeysSecret.key) -}}
{{- end -}}
{{- toJson $m -}}
{{- end -}}

{{/* The request-limit flags of a limits value (null entries: not passed), as a JSON list of pairs. */}}
{{- define "pagoda.limitFlags" -}}
{{- $l := default dict . -}}
{{- toJson (list
  (list "--max-n" $l.maxN) (list "--max-prompt-bytes" $l.maxPromptBytes) (list "--max-messages" $l.maxMessages)
  (list "--max-prompt-tokens" $l.maxPromptTokens) (list "--max-logit-bias" $l.maxLogitBias)
  (list "--max-stop" $l.maxStop) (list "--max-id-bytes" $l.maxIdBytes)) -}}
{{- end -}}

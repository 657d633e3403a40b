{{/* Render-time checks of combinations the values schema cannot express. Each failure
names the values to change. Ray's resource arithmetic is fixed-point (1/10000), hence the
small tolerance. */}}
{{- define "specserve.checks" -}}
{{- include "specserve.checkGroups" . -}}
{{- include "specserve.checkPorts" . -}}
{{- if ge (float64 .Values.app.target.admit_wait_s) (float64 .Values.app.router.call_timeout_s) -}}
{{- fail (printf "app.target.admit_wait_s (%v) must be below app.router.call_timeout_s (%v): a row waiting for KV room that long times out at the router and is sent again" .Values.app.target.admit_wait_s .Values.app.router.call_timeout_s) -}}
{{- end -}}
{{- $groups := include "specserve.groups" . | fromJson -}}
{{- $used := dict -}}
{{- range $dep := list "router" "drafter" "target" -}}
{{- $gname := get $.Values.placement $dep -}}
{{- if not (hasKey $groups $gname) -}}
{{- fail (printf "placement.%s: %q is not a group (head or one of workerGroups: %s)" $dep $gname (keys $.Values.workerGroups | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $need := include "specserve.checkDeployment" (dict "root" $ "dep" $dep "gname" $gname "g" (get $groups $gname)) | fromJson -}}
{{- $acc := default (dict "CPU" 0.0 "GPU" 0.0 "slots" 0.0) (get $used $gname) -}}
{{- range $k := list "CPU" "GPU" "slots" -}}
{{- $_ := set $acc $k (addf (get $acc $k) (mulf (get $need $k) (get $need "min"))) -}}
{{- end -}}
{{- $_ := set $used $gname $acc -}}
{{- end -}}
{{- range $gname, $acc := $used -}}
{{- $g := get $groups $gname -}}
{{- range $k, $cap := dict "CPU" $g.rayCpus "GPU" $g.gpus "slots" $g.replicaSlots -}}
{{- $total := mulf $cap $g.pods -}}
{{- if gt (float64 (get $acc $k)) (addf $total 0.0001) -}}
{{- fail (printf "group %q cannot hold the min_replicas of the deployments placed on it: they need %v %s in all, its %v pod(s) offer %v (raise the group's pods or capacity, or lower min_replicas)" $gname (get $acc $k) $k $g.pods $total) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* One deployment against the group it is placed on: (dict "root" "dep" "gname" "g").
Returns JSON {CPU, GPU, slots, min}: what one replica needs and its min_replicas. */}}
{{- define "specserve.checkDeployment" -}}
{{- $v := .root.Values -}}
{{- $dep := .dep -}}
{{- $g := .g -}}
{{- $gname := .gname -}}
{{- $sc := get (get $v.app $dep) "scaling" -}}
{{- $tp := ternary (int $v.app.target.tp_size) 1 (eq $dep "target") -}}
{{- $where := ternary "head" (printf "workerGroups.%s" $gname) (eq $gname "head") -}}
{{- if gt (int $sc.min_replicas) (int $sc.max_replicas) -}}
{{- fail (printf "app.%s.scaling: min_replicas (%v) must be <= max_replicas (%v)" $dep $sc.min_replicas $sc.max_replicas) -}}
{{- end -}}
{{- if and (eq $dep "target") (gt (int $g.gpus) 0) (ne (mod (int $g.gpus) $tp) 0) -}}
{{- fail (printf "app.target.tp_size=%d must divide %s.gpus=%v (the GPUs of one target pod): a target replica is tp_size ranks packed on one pod" $tp $where $g.gpus) -}}
{{- end -}}
{{- if and (ne $dep "router") (gt (int $g.gpus) 0) (eq (float64 $sc.num_gpus) 0.0) -}}
{{- fail (printf "app.%s.scaling.num_gpus is 0 but group %q has %v GPU(s) per pod: the replicas would run on CPU next to idle GPUs (set num_gpus, or gpus: 0 for a CPU group)" $dep $gname $g.gpus) -}}
{{- end -}}
{{- with $sc.accelerator_type -}}
{{- if ne . $g.acceleratorType -}}
{{- fail (printf "app.%s.scaling.accelerator_type=%q but its group %q has acceleratorType %q" $dep . $gname $g.acceleratorType) -}}
{{- end -}}
{{- end -}}
{{- $need := dict "CPU" (mulf $sc.num_cpus $tp) "GPU" (mulf $sc.num_gpus $tp) "slots" (float64 $tp) "min" (float64 $sc.min_replicas) -}}
{{- $perPod := -1 -}}
{{- range $k, $cap := dict "CPU" $g.rayCpus "GPU" $g.gpus "slots" $g.replicaSlots -}}
{{- $n := get $need $k -}}
{{- if gt (float64 $n) (addf $cap 0.0001) -}}
{{- $field := get (dict "CPU" "rayCpus" "GPU" "gpus" "slots" "replicaSlots") $k -}}
{{- $per := ternary (printf " (%d ranks: tp_size)" $tp) "" (gt $tp 1) -}}
{{- fail (printf "app.%s: one replica needs %v %s%s but a %q pod offers %v (%s.%s)" $dep $n $k $per $gname $cap $where $field) -}}
{{- end -}}
{{- if gt (float64 $n) 0.0 -}}
{{- $fit := int (floor (divf (addf $cap 0.0001) $n)) -}}
{{- if or (lt $perPod 0) (lt $fit $perPod) -}}{{- $perPod = $fit -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if gt (int $sc.min_replicas) (mul $perPod (int $g.pods)) -}}
{{- fail (printf "app.%s.scaling.min_replicas=%v cannot fit: a %q pod hosts %d replica(s) and the group has at most %v pod(s) (%s.maxReplicas, or replicas with autoscaling off)" $dep $sc.min_replicas $gname $perPod $g.pods $where) -}}
{{- end -}}
{{- toJson $need -}}
{{- end -}}

{{- define "specserve.checkGroups" -}}
{{- $owned := list "num-cpus" "num-gpus" "resources" "metrics-export-port" -}}
{{- range $k := $owned -}}
{{- if hasKey $.Values.head.rayStartParams $k -}}
{{- fail (printf "head.rayStartParams.%s is set by the chart (from rayCpus, replicaSlots, observability.metrics.port)" $k) -}}
{{- end -}}
{{- end -}}
{{- range $name, $g := .Values.workerGroups -}}
{{- if eq $name "head" -}}
{{- fail "workerGroups.head: 'head' is the head group's name; pick another group name" -}}
{{- end -}}
{{- if or (gt (int $g.minReplicas) (int $g.replicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "workerGroups.%s: need minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" $name $g.minReplicas $g.replicas $g.maxReplicas) -}}
{{- end -}}
{{- range $k := $owned -}}
{{- if hasKey $g.rayStartParams $k -}}
{{- fail (printf "workerGroups.%s.rayStartParams.%s is set by the chart (from rayCpus, gpus, replicaSlots, observability.metrics.port)" $name $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) -}}
{{- fail "redis.mode=external needs redis.external.existingSecret (a Secret holding the Redis URL)" -}}
{{- end -}}
{{- $envNames := list -}}
{{- range .Values.extraEnv -}}{{- $envNames = append $envNames .name -}}{{- end -}}
{{- if and .Values.app.security.require_api_key (not .Values.apiKeys.existingSecret) (not (has "SPECSERVE_API_KEYS" $envNames)) -}}
{{- fail "app.security.require_api_key needs API keys: apiKeys.existingSecret (or SPECSERVE_API_KEYS in extraEnv), else the Router refuses to start" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled .Values.observability.metrics.podMonitor.enabled (not .Values.networkPolicy.metricsFrom) -}}
{{- fail "observability.metrics.podMonitor.enabled with networkPolicy.enabled needs networkPolicy.metricsFrom (your Prometheus pods), else every scrape is refused" -}}
{{- end -}}
{{- end -}}

{{- define "specserve.checkPorts" -}}
{{- $ports := dict "serve.grpcPort" .Values.serve.grpcPort "serve.http.port" .Values.serve.http.port "observability.metrics.port" .Values.observability.metrics.port "Ray's GCS (6379)" 6379 "Ray's dashboard (8265)" 8265 "Ray's client server (10001)" 10001 -}}
{{- $seen := dict -}}
{{- range $name := keys $ports | sortAlpha -}}
{{- $p := toString (get $ports $name) -}}
{{- if hasKey $seen $p -}}
{{- fail (printf "%s and %s are both port %s: every Ray pod port must differ" (get $seen $p) $name $p) -}}
{{- end -}}
{{- $_ := set $seen $p $name -}}
{{- end -}}
{{- end -}}

// Package deploy holds the files operators deploy with; its tests check
// them against what they configure.
package deploy

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

const chart = "helm/vllm-hi"

// helm runs the helm the module pins as a tool (go.mod's tool line:
// helm.sh/helm/v4), so the tests need nothing installed beside Go.
func helm(args ...string) (string, error) {
	readChart()
	cmd := exec.Command("go", append([]string{"tool", "helm"}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("helm %s: %w\n%s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// readChart reads every file of the chart in this process: go test caches
// a passing result until a file the test opened changes, and helm's reads
// (another process) would not count.
var readChart = sync.OnceFunc(func() {
	_ = filepath.WalkDir(chart, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			_, _ = os.ReadFile(path)
		}
		return nil
	})
})

// rendered is one `helm template` of the chart, every object decoded.
type rendered struct {
	secrets      []*corev1.Secret
	configMaps   []*corev1.ConfigMap
	pvcs         []*corev1.PersistentVolumeClaim
	services     []*corev1.Service
	deployments  []*appsv1.Deployment
	statefulSets []*appsv1.StatefulSet
	monitors     []map[string]any
}

// render templates the chart with these --set values, and decodes every
// document strictly into its Kubernetes API type: an unknown or misspelt
// field fails.
func render(t *testing.T, set ...string) *rendered {
	t.Helper()
	args := []string{"template", "rel", chart, "--namespace", "llm"}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	out, err := helm(args...)
	if err != nil {
		t.Fatal(err)
	}
	r := &rendered{}
	for i, doc := range strings.Split(out, "\n---\n") {
		var head struct{ Kind, APIVersion string }
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatalf("document %d: %v", i, err)
		}
		decode := func(obj any) {
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Fatalf("document %d (%s): %v\n%s", i, head.Kind, err, doc)
			}
		}
		switch head.Kind {
		case "":
			continue // a comment-only document
		case "Secret":
			r.secrets = append(r.secrets, decoded[corev1.Secret](decode))
		case "ConfigMap":
			r.configMaps = append(r.configMaps, decoded[corev1.ConfigMap](decode))
		case "PersistentVolumeClaim":
			r.pvcs = append(r.pvcs, decoded[corev1.PersistentVolumeClaim](decode))
		case "Service":
			r.services = append(r.services, decoded[corev1.Service](decode))
		case "Deployment":
			r.deployments = append(r.deployments, decoded[appsv1.Deployment](decode))
		case "StatefulSet":
			r.statefulSets = append(r.statefulSets, decoded[appsv1.StatefulSet](decode))
		case "ServiceMonitor":
			// The Prometheus Operator's type is not in k8s.io/api: its
			// fields are checked where the test reads them.
			if head.APIVersion != "monitoring.coreos.com/v1" {
				t.Fatalf("ServiceMonitor's apiVersion %q", head.APIVersion)
			}
			var o map[string]any
			decode(&o)
			r.monitors = append(r.monitors, o)
		default:
			t.Fatalf("document %d: kind %q has no check here", i, head.Kind)
		}
	}
	return r
}

// decoded is a new T that decode filled.
func decoded[T any](decode func(any)) *T {
	o := new(T)
	decode(o)
	return o
}

func (r *rendered) host(t *testing.T) *appsv1.Deployment {
	t.Helper()
	if len(r.deployments) != 1 {
		t.Fatalf("want one Deployment (the Host), got %d", len(r.deployments))
	}
	return r.deployments[0]
}

// service is the Service whose selector picks these pod labels.
func (r *rendered) service(labels map[string]string) *corev1.Service {
	for _, s := range r.services {
		match := len(s.Spec.Selector) > 0
		for k, v := range s.Spec.Selector {
			match = match && labels[k] == v
		}
		if match {
			return s
		}
	}
	return nil
}

func TestChartLints(t *testing.T) {
	for _, set := range [][]string{nil, {"host.store=etcd://etcd:2379", "host.replicas=3", "metrics.serviceMonitor.enabled=true"}} {
		args := []string{"lint", "--strict", chart}
		for _, s := range set {
			args = append(args, "--set", s)
		}
		if out, err := helm(args...); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
	}
}

// flag is the value of an argument given as --name=value or --name value
// ("" when absent).
func flag(args []string, name string) string {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
	}
	return ""
}

func env(c *corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

// containers are an engine pod's engine and agent containers.
func containers(t *testing.T, spec *corev1.PodSpec) (engine, agent *corev1.Container) {
	t.Helper()
	for i := range spec.Containers {
		switch spec.Containers[i].Name {
		case "engine":
			engine = &spec.Containers[i]
		case "agent":
			agent = &spec.Containers[i]
		}
	}
	if engine == nil || agent == nil {
		t.Fatal("want the containers engine and agent")
	}
	return engine, agent
}

// mountOf is the volume a container sees path on ("" when none).
func mountOf(c *corev1.Container, path string) string {
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/") {
			return m.Name
		}
	}
	return ""
}

// The tokens: generated at install (never a fixed default), each long
// enough for the Host, a different pair on every fresh render, and kept
// by the cluster's copy on upgrades (lookup; `helm template` has no
// cluster). Mounted owner- and group-readable, for the pods' fsGroup.
func TestChartGeneratesTheTokens(t *testing.T) {
	a, b := render(t), render(t)
	if len(a.secrets) != 1 || len(b.secrets) != 1 {
		t.Fatalf("want one Secret, got %d", len(a.secrets))
	}
	s := a.secrets[0]
	if s.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Errorf("the tokens' Secret goes with an uninstall: agents outside the release may hold them")
	}
	for _, k := range []string{"admin-token", "agent-token"} {
		v := s.Data[k]
		if len(v) < 32 || strings.Contains(string(v), "change-me") {
			t.Errorf("%s: %q is no generated token", k, v)
		}
		if bytes.Equal(v, b.secrets[0].Data[k]) {
			t.Errorf("%s is the same in two installs: a fixed default", k)
		}
	}
	if bytes.Equal(s.Data["admin-token"], s.Data["agent-token"]) {
		t.Error("the admin and agent tokens are equal")
	}
	// With a Secret of the operator's, none is rendered and every pod
	// mounts theirs.
	own := render(t, "tokens.existingSecret=mine")
	if len(own.secrets) != 0 {
		t.Errorf("tokens.existingSecret set, the chart still renders a Secret")
	}
	checkTokens(t, own, "mine")
	checkTokens(t, a, s.Name)
}

func checkTokens(t *testing.T, r *rendered, secret string) {
	t.Helper()
	specs := map[string]*corev1.PodSpec{}
	for _, d := range r.deployments {
		specs[d.Name] = &d.Spec.Template.Spec
	}
	for _, ss := range r.statefulSets {
		specs[ss.Name] = &ss.Spec.Template.Spec
	}
	for who, spec := range specs {
		found := false
		for _, v := range spec.Volumes {
			if v.Secret == nil || v.Name != "tokens" {
				continue
			}
			found = true
			if v.Secret.SecretName != secret {
				t.Errorf("%s mounts Secret %q, not %q", who, v.Secret.SecretName, secret)
			}
			if m := v.Secret.DefaultMode; m == nil || *m&0o040 == 0 || *m&0o007 != 0 {
				t.Errorf("%s: the tokens' defaultMode %v: want group-readable, nothing for others", who, m)
			}
		}
		if !found {
			t.Errorf("%s mounts no tokens", who)
		}
		if spec.SecurityContext == nil || spec.SecurityContext.FSGroup == nil {
			t.Errorf("%s: no fsGroup: the non-root vhi cannot read the tokens", who)
		}
	}
}

// The engines deploy migration pairs as shipped: per model an A and a B,
// each engine with the plugin's --vllm-hi-type (without it the engine
// registers as routing-only) matching its agent's VLLM_HI_TYPE, its own
// agent off (the sidecar is the agent), the hooks' token file the one the
// agent presents, both on the mounted Secret's agent-token key, and the
// core channel's socket on a volume both containers share.
func TestChartDeploysMigratablePairs(t *testing.T) {
	r := render(t, "models[0].name=qwen3-8b", "models[0].model=Qwen/Qwen3-8B", "models[0].roles={A,B}",
		"models[1].name=llama", "models[1].model=meta-llama/Llama-3.1-8B", "models[1].roles={A,B,C}")
	types := map[string][]string{}
	for _, ss := range r.statefulSets {
		spec := ss.Spec.Template.Spec
		engine, agent := containers(t, &spec)
		typ, model := flag(engine.Args, "--vllm-hi-type"), ss.Spec.Template.Labels["vllm-hi/model"]
		if typ == "" || env(agent, "VLLM_HI_TYPE") != typ || ss.Spec.Template.Labels["vllm-hi/type"] != typ {
			t.Errorf("%s: the engine's --vllm-hi-type %q, its agent's VLLM_HI_TYPE %q, its label %q",
				ss.Name, typ, env(agent, "VLLM_HI_TYPE"), ss.Spec.Template.Labels["vllm-hi/type"])
		}
		types[model] = append(types[model], typ)
		if env(engine, "VLLM_HI_AGENT") != "off" {
			t.Errorf("%s: the engine starts an agent of its own beside the sidecar", ss.Name)
		}
		tok := env(engine, "VLLM_HI_ENGINE_TOKEN_FILE")
		if tok == "" || flag(agent.Args, "--token-file") != tok {
			t.Errorf("%s: the hooks' token %q, the agent's --token-file %q: want the same file", ss.Name, tok, flag(agent.Args, "--token-file"))
		}
		if v := mountOf(engine, tok); v != "tokens" || mountOf(agent, tok) != "tokens" {
			t.Errorf("%s: %s is on volume %q, not the tokens' Secret", ss.Name, tok, v)
		}
		for _, v := range spec.Volumes {
			if v.Name == "tokens" && (len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "agent-token" ||
				!strings.HasSuffix(tok, "/"+v.Secret.Items[0].Path)) {
				t.Errorf("%s: the tokens' volume maps %v, the engine reads %s", ss.Name, v.Secret.Items, tok)
			}
		}
		sock := flag(engine.Args, "--vllm-hi-core-socket")
		if sock == "" || flag(agent.Args, "--engine-core-socket") != sock {
			t.Errorf("%s: the core channel: engine %q, agent %q", ss.Name, sock, flag(agent.Args, "--engine-core-socket"))
		}
		if v := mountOf(engine, sock); v == "" || v != mountOf(agent, sock) {
			t.Errorf("%s: the core socket %s is not on a volume both containers mount", ss.Name, sock)
		}
		if engine.StartupProbe == nil || engine.StartupProbe.HTTPGet == nil || engine.StartupProbe.HTTPGet.Path != "/health" {
			t.Errorf("%s: the engine has no startup probe on /health (vLLM loads the model first)", ss.Name)
		}
		if agent.ReadinessProbe == nil || agent.ReadinessProbe.HTTPGet == nil || agent.ReadinessProbe.HTTPGet.Path != "/healthz" {
			t.Errorf("%s: the agent's readiness is not its /healthz", ss.Name)
		}
		if got := engine.Resources.Limits["nvidia.com/gpu"]; got.Value() != 1 {
			t.Errorf("%s: the engine asks for %v GPUs, want 1", ss.Name, got.String())
		}
		enginePodDrains(t, ss)
		servesItsPorts(t, r, ss.Name, &spec, ss.Spec.Template.Labels)
	}
	for model, want := range map[string][]string{"qwen3-8b": {"A", "B"}, "llama": {"A", "B", "C"}} {
		if got := types[model]; !slices.Equal(got, want) {
			t.Errorf("model %s: engines %v, want %v", model, got, want)
		}
	}
}

// The engine pod drains before its engine stops: the agent drains on
// SIGTERM and writes the drained file on a volume the engine's preStop
// hook waits on, within the pod's grace period; the Host can reach the
// agent, the engine and the data port at the pod IP.
func enginePodDrains(t *testing.T, ss *appsv1.StatefulSet) {
	t.Helper()
	spec := ss.Spec.Template.Spec
	engine, agent := containers(t, &spec)
	grace, err := time.ParseDuration(flag(agent.Args, "--drain-grace"))
	if err != nil {
		t.Fatalf("%s: the agent's --drain-grace: %v", ss.Name, err)
	}
	if spec.TerminationGracePeriodSeconds == nil || time.Duration(*spec.TerminationGracePeriodSeconds)*time.Second <= grace {
		t.Errorf("%s: the grace period must exceed --drain-grace %v", ss.Name, grace)
	}
	drained := flag(agent.Args, "--drained-file")
	ps := engine.Lifecycle
	if drained == "" || ps == nil || ps.PreStop == nil || ps.PreStop.Exec == nil ||
		!strings.Contains(strings.Join(ps.PreStop.Exec.Command, " "), drained) {
		t.Errorf("%s: the engine's preStop hook does not wait for the agent's drained file %q", ss.Name, drained)
	}
	if a, e := mountOf(agent, drained), mountOf(engine, drained); a == "" || a != e {
		t.Errorf("%s: %s is on volume %q for the agent and %q for the engine: they must share one", ss.Name, drained, a, e)
	}
	for _, f := range []string{"--engine", "--listen", "--advertise-host"} {
		if v := flag(agent.Args, f); !strings.Contains(v, "$(POD_IP)") {
			t.Errorf("%s: the agent's %s %q: the Host in another pod must reach it at the pod IP", ss.Name, f, v)
		}
	}
	if port := fmt.Sprint(engine.Ports[0].ContainerPort); !strings.HasSuffix(flag(agent.Args, "--engine"), ":"+port) ||
		flag(engine.Args, "--port") != port {
		t.Errorf("%s: the agent's --engine %q, the engine's --port %q, its container port %s", ss.Name,
			flag(agent.Args, "--engine"), flag(engine.Args, "--port"), port)
	}
	if p := env(agent, "VLLM_HI_DATA_PORT"); !slices.ContainsFunc(agent.Ports, func(cp corev1.ContainerPort) bool {
		return fmt.Sprint(cp.ContainerPort) == p
	}) {
		t.Errorf("%s: the data port %s is not one of the agent's container ports", ss.Name, p)
	}
}

// servesItsPorts: the Service selecting these pods targets ports the pod
// names.
func servesItsPorts(t *testing.T, r *rendered, who string, spec *corev1.PodSpec, labels map[string]string) {
	t.Helper()
	svc := r.service(labels)
	if svc == nil {
		t.Errorf("%s: no Service selects its pods", who)
		return
	}
	named := map[string]int32{}
	for _, c := range spec.Containers {
		for _, p := range c.Ports {
			named[p.Name] = p.ContainerPort
		}
	}
	for _, p := range svc.Spec.Ports {
		if _, ok := named[p.TargetPort.StrVal]; !ok {
			t.Errorf("%s: Service %s targets port %q, which no container names", who, svc.Name, p.TargetPort.StrVal)
		}
	}
}

// One Host on bolt keeps its state on a volume and restarts in place; its
// agents reach it through its Service, and its probes are its real health.
func TestChartRunsOneHostOnBolt(t *testing.T) {
	r := render(t)
	d := r.host(t)
	spec := d.Spec.Template.Spec
	c := spec.Containers[0]
	if *d.Spec.Replicas != 1 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("one Host on bolt: replicas %d, strategy %s", *d.Spec.Replicas, d.Spec.Strategy.Type)
	}
	if len(r.pvcs) != 1 || flag(c.Args, "--store") != "" {
		t.Fatalf("bolt: want one volume claim and no --store, got %d, %q", len(r.pvcs), flag(c.Args, "--store"))
	}
	if v := mountOf(&c, flag(c.Args, "--data-dir")+"/x"); v != "state" {
		t.Errorf("--data-dir is on volume %q", v)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" ||
		c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/livez" {
		t.Errorf("the Host's probes: want /readyz and /livez")
	}
	if spec.SecurityContext.RunAsNonRoot == nil || !*spec.SecurityContext.RunAsNonRoot {
		t.Errorf("the Host runs as root")
	}
	for _, f := range []string{"--admin-token-file", "--agent-token-file"} {
		if mountOf(&c, flag(c.Args, f)) != "tokens" {
			t.Errorf("the Host's %s %q is not on the tokens' Secret", f, flag(c.Args, f))
		}
	}
	servesItsPorts(t, r, d.Name, &spec, d.Spec.Template.Labels)
	svc := r.service(d.Spec.Template.Labels)
	for _, ss := range r.statefulSets {
		_, agent := containers(t, &ss.Spec.Template.Spec)
		if want := fmt.Sprintf("%s:%d", svc.Name, svc.Spec.Ports[0].Port); env(agent, "VLLM_HI_HOST") != want {
			t.Errorf("%s: the agent's VLLM_HI_HOST %q, the Host's Service is %s", ss.Name, env(agent, "VLLM_HI_HOST"), want)
		}
	}
	grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
	if st, err := time.ParseDuration(flag(c.Args, "--shutdown-timeout")); err != nil || grace <= st {
		t.Errorf("the Host's grace period %v must exceed --shutdown-timeout %q", grace, flag(c.Args, "--shutdown-timeout"))
	}
}

// Several Hosts share etcd (no volume: the state is there); on bolt the
// chart refuses more than one.
func TestChartRunsSeveralHostsOnEtcd(t *testing.T) {
	r := render(t, "host.store=etcd://etcd-0.etcd:2379\\,etcd-1.etcd:2379", "host.replicas=3", "host.etcdTLSSecret=etcd-client")
	d := r.host(t)
	c := d.Spec.Template.Spec.Containers[0]
	if *d.Spec.Replicas != 3 || len(r.pvcs) != 0 {
		t.Errorf("replicas %d, volume claims %d", *d.Spec.Replicas, len(r.pvcs))
	}
	if got := flag(c.Args, "--store"); got != "etcd://etcd-0.etcd:2379,etcd-1.etcd:2379" {
		t.Errorf("--store %q", got)
	}
	for _, f := range []string{"--etcd-ca-file", "--etcd-cert-file", "--etcd-key-file"} {
		if mountOf(&c, flag(c.Args, f)) != "etcd-tls" {
			t.Errorf("%s %q is not on the etcd-tls Secret", f, flag(c.Args, f))
		}
	}
	for _, bad := range [][]string{{"host.replicas=2"}, {"host.store=consul://x"}, {"models[0].name=Bad_Name"},
		{"models[0].name=m", "models[0].model=x", "models[0].roles={A}"},
		{"models[0].name=m", "models[0].model=x", "models[0].roles={B,C}"}, {"models[0].roles={A,B}"}} {
		args := []string{"template", "rel", chart}
		for _, s := range bad {
			args = append(args, "--set", s)
		}
		if _, err := helm(args...); err == nil || !strings.Contains(err.Error(), "want") && !strings.Contains(err.Error(), "need") {
			t.Errorf("--set %v rendered, or failed without saying why: %v", bad, err)
		}
	}
}

// Prometheus finds the Host's /metrics through a ServiceMonitor, and
// Grafana's sidecar the dashboard (deploy/grafana's, which internal/host's
// TestGrafanaDashboard checks against the metrics).
func TestChartShipsMonitoring(t *testing.T) {
	r := render(t, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
	if len(r.monitors) != 1 {
		t.Fatalf("want one ServiceMonitor, got %d", len(r.monitors))
	}
	m := r.monitors[0]
	if labels, _ := m["metadata"].(map[string]any)["labels"].(map[string]any); labels["release"] != "prom" {
		t.Errorf("the ServiceMonitor's labels %v lack release=prom", labels)
	}
	spec := m["spec"].(map[string]any)
	sel := spec["selector"].(map[string]any)["matchLabels"].(map[string]any)
	host := r.host(t)
	svc := r.service(host.Spec.Template.Labels)
	for k, v := range sel {
		if svc.Labels[k] != v {
			t.Errorf("the ServiceMonitor selects %s=%v, the Host's Service is labelled %v", k, v, svc.Labels)
		}
	}
	ep := spec["endpoints"].([]any)[0].(map[string]any)
	if ep["port"] != svc.Spec.Ports[0].Name || ep["path"] != "/metrics" {
		t.Errorf("the ServiceMonitor scrapes port %v path %v", ep["port"], ep["path"])
	}
	// deploy/grafana/vllm-hi.json is a link to the chart's copy: one file.
	want, err := os.ReadFile("grafana/vllm-hi.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(r.configMaps) != 1 || r.configMaps[0].Labels["grafana_dashboard"] != "1" ||
		strings.TrimSpace(r.configMaps[0].Data["vllm-hi.json"]) != strings.TrimSpace(string(want)) {
		t.Errorf("the dashboard's ConfigMap is not deploy/grafana's dashboard with Grafana's sidecar label")
	}
	if off := render(t, "metrics.serviceMonitor.enabled=false", "metrics.dashboard.enabled=false"); len(off.monitors)+len(off.configMaps) != 0 {
		t.Errorf("monitoring off, still rendered")
	}
}

// Two engines of a model on one node share GPU memory through cuda_ipc.
func TestChartColocatesPairsForCUDAIPC(t *testing.T) {
	r := render(t, "engine.colocatePairs=true", "engine.hostIPC=true")
	for _, ss := range r.statefulSets {
		spec := ss.Spec.Template.Spec
		if !spec.HostIPC || spec.Affinity == nil || spec.Affinity.PodAffinity == nil ||
			len(spec.Affinity.PodAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 1 {
			t.Fatalf("%s: hostIPC %v, affinity %+v", ss.Name, spec.HostIPC, spec.Affinity)
		}
		term := spec.Affinity.PodAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0]
		for k, v := range term.LabelSelector.MatchLabels {
			if ss.Spec.Template.Labels[k] != v {
				t.Errorf("%s: the affinity selects %s=%s, which its own pods lack", ss.Name, k, v)
			}
		}
		if term.TopologyKey != "kubernetes.io/hostname" {
			t.Errorf("%s: topology %s", ss.Name, term.TopologyKey)
		}
	}
}

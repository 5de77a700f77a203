// Package deploy holds the files operators deploy with; its tests check
// them against what they configure.
package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// objects decodes every document of a manifest strictly into its
// Kubernetes API type: an unknown or misspelt field fails.
func objects(t *testing.T, path string) []any {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []any
	for i, doc := range strings.Split(string(raw), "\n---\n") {
		var head struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatalf("%s document %d: %v", path, i, err)
		}
		var obj any
		switch head.Kind {
		case "Secret":
			obj = &corev1.Secret{}
		case "PersistentVolumeClaim":
			obj = &corev1.PersistentVolumeClaim{}
		case "Service":
			obj = &corev1.Service{}
		case "Deployment":
			obj = &appsv1.Deployment{}
		case "StatefulSet":
			obj = &appsv1.StatefulSet{}
		default:
			t.Fatalf("%s document %d: kind %q has no check here", path, i, head.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("%s document %d (%s): %v", path, i, head.Kind, err)
		}
		out = append(out, obj)
	}
	return out
}

func TestManifestsDecodeStrictly(t *testing.T) {
	paths, _ := filepath.Glob("kubernetes/*.yaml")
	if len(paths) < 2 {
		t.Fatalf("manifests: %v", paths)
	}
	for _, p := range paths {
		if len(objects(t, p)) == 0 {
			t.Errorf("%s: no objects", p)
		}
	}
}

// flag is the value after name in args ("" when absent).
func flag(args []string, name string) string {
	if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

// The engine pod drains before its engine stops: the agent drains on
// SIGTERM and writes the drained file on a volume the engine's preStop
// hook waits on, within the pod's grace period; the Host can reach both
// the agent and the engine at the pod IP.
func TestEnginePodDrainsBeforeItStops(t *testing.T) {
	var ss *appsv1.StatefulSet
	for _, o := range objects(t, "kubernetes/vllm-with-agent.yaml") {
		if s, ok := o.(*appsv1.StatefulSet); ok {
			ss = s
		}
	}
	if ss == nil {
		t.Fatal("no StatefulSet")
	}
	spec := ss.Spec.Template.Spec
	var engine, agent *corev1.Container
	for i := range spec.Containers {
		switch spec.Containers[i].Name {
		case "engine":
			engine = &spec.Containers[i]
		case "vhi-agent":
			agent = &spec.Containers[i]
		}
	}
	if engine == nil || agent == nil {
		t.Fatal("want the containers engine and vhi-agent")
	}
	grace, err := time.ParseDuration(flag(agent.Args, "--drain-grace"))
	if err != nil {
		t.Fatalf("the agent's --drain-grace: %v", err)
	}
	if spec.TerminationGracePeriodSeconds == nil || time.Duration(*spec.TerminationGracePeriodSeconds)*time.Second <= grace {
		t.Fatalf("terminationGracePeriodSeconds %v must exceed --drain-grace %v", spec.TerminationGracePeriodSeconds, grace)
	}
	drained := flag(agent.Args, "--drained-file")
	if drained == "" {
		t.Fatal("the agent writes no --drained-file")
	}
	ps := engine.Lifecycle
	if ps == nil || ps.PreStop == nil || ps.PreStop.Exec == nil || !strings.Contains(strings.Join(ps.PreStop.Exec.Command, " "), drained) {
		t.Fatalf("the engine's preStop hook does not wait for %s", drained)
	}
	mountOf := func(c *corev1.Container, dir string) string {
		for _, m := range c.VolumeMounts {
			if strings.HasPrefix(dir, m.MountPath+"/") {
				return m.Name
			}
		}
		return ""
	}
	if a, e := mountOf(agent, drained), mountOf(engine, drained); a == "" || a != e {
		t.Fatalf("%s is on volume %q for the agent and %q for the engine: they must share one", drained, a, e)
	}
	for _, f := range []string{"--engine", "--listen", "--advertise-host"} {
		if v := flag(agent.Args, f); !strings.Contains(v, "$(POD_IP)") {
			t.Errorf("the agent's %s %q: the Host in another pod must reach it at the pod IP", f, v)
		}
	}
	port := fmt.Sprint(engine.Ports[0].ContainerPort)
	if !strings.HasSuffix(flag(agent.Args, "--engine"), ":"+port) {
		t.Errorf("the agent's --engine %q is not the engine's port %s", flag(agent.Args, "--engine"), port)
	}
}

// The Host's Service selects the Host's pods.
func TestHostServiceSelectsTheHost(t *testing.T) {
	var dep *appsv1.Deployment
	var svc *corev1.Service
	for _, o := range objects(t, "kubernetes/vhi-host.yaml") {
		switch v := o.(type) {
		case *appsv1.Deployment:
			dep = v
		case *corev1.Service:
			svc = v
		}
	}
	if dep == nil || svc == nil {
		t.Fatal("want a Deployment and a Service")
	}
	for k, v := range svc.Spec.Selector {
		if dep.Spec.Template.Labels[k] != v {
			t.Fatalf("the Service selects %s=%s, the Host's pods are labelled %v", k, v, dep.Spec.Template.Labels)
		}
	}
}

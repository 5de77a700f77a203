// Package switching is the Host's model switching (the vllm-switch-
// controller seed): long-lived engines that share a GPU serve several
// models, one awake at a time, asleep otherwise (vLLM's sleep mode). A
// request for a sleeping model is queued, never failed: the Host drains
// the group's awake model (moving its streams to another instance by
// migration where one exists, else waiting for them), puts it to sleep
// and checks it sleeps, wakes the target and checks it is awake and
// answers its probe as it did before, then releases the queue. Every
// transition of a group is serialized in one goroutine, bounded by one
// deadline; a failed one leaves the model in error, failing closed, and
// the next transition first reconciles what the engines say.
package switching

import (
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/durations"
)

// Model is one alias of the configuration's models: mapping.
type Model struct {
	// ServedModelName is the engine's --served-model-name (default: the
	// alias): the Host rewrites a request's model to it.
	ServedModelName string `yaml:"served_model_name"`
	BackendURL      string `yaml:"backend_url"`
	// SleepLevel is vLLM's /sleep level: 1 keeps the weights in host
	// memory, 2 discards them (the wake-up then reloads them).
	SleepLevel int `yaml:"sleep_level"`
	// WakeTags are the /wake_up calls' tags, one call per tag in order
	// (default: one call without tags; level 2: weights, reload, kv_cache).
	WakeTags []string `yaml:"wake_tags"`
	// Group names the GPU the model shares with others: at most one model
	// of a group is awake.
	Group string `yaml:"group"`
	// HostMemoryGB is the host memory the model's weights take while it
	// sleeps at level 1 (its weights offloaded there): what the
	// controller's host_memory_budget_gb accounts. 0: not accounted.
	HostMemoryGB float64 `yaml:"host_memory_gb"`
	// Priority orders the queue of a group: the model with the highest
	// priority among those with waiting requests is woken next; ties go
	// to the longest-waiting request.
	Priority int `yaml:"priority"`
	// LaunchCommand, Env and Cwd start the backend (vhi launch); without
	// them it is managed elsewhere.
	LaunchCommand []string          `yaml:"launch_command"`
	Env           map[string]string `yaml:"env"`
	Cwd           string            `yaml:"cwd"`
	// TTLS puts the model to sleep once no request used it for this long
	// (seconds; llama-swap's ttl): its GPU memory goes back while nothing
	// asks for it. 0: it stays awake until another model of its group is
	// asked for.
	TTLS durations.Seconds `yaml:"ttl_s"`
}

// ttl is how long the model may sit idle awake (0: for ever).
func (m Model) ttl() time.Duration { return seconds(m.TTLS, 0) }

// Policies.
const (
	// PolicySleepPrevious: models without a group share one (the seed's
	// single GPU): waking one puts the previous to sleep.
	PolicySleepPrevious = "always_sleep_previous"
	// PolicyAwakePrevious: a model without a group is its own group: it
	// is woken when asked for and never put to sleep for another.
	PolicyAwakePrevious = "always_awake_previous"
)

// Controller is the configuration's controller: mapping.
type Controller struct {
	Policy            string `yaml:"policy"`
	StartupAwakeModel string `yaml:"startup_awake_model"`
	// RequestTimeoutS bounds how long a request waits queued for its
	// model (default 300); once it runs it is not bounded here.
	RequestTimeoutS durations.Seconds `yaml:"request_timeout_s"`
	// SwitchTimeoutS bounds one switch end to end: drain, sleep, wake,
	// checks (default 120).
	SwitchTimeoutS durations.Seconds `yaml:"switch_timeout_s"`
	// MinAwakeS: a model woken less than this ago is not put to sleep for
	// another (the anti-thrash floor).
	MinAwakeS durations.Seconds `yaml:"min_awake_s"`
	// ProbePrompt is the greedy probe checked after every wake-up
	// against the answer recorded the first time the model was seen
	// awake (default: a fixed sentence).
	ProbePrompt string `yaml:"probe_prompt"`
	// MaxPrewarmS bounds POST /admin/prewarm's ttl_s (default 3600).
	MaxPrewarmS durations.Seconds `yaml:"max_prewarm_s"`
	// HostMemoryBudgetGB bounds the host memory level-1 sleepers hold
	// together (their host_memory_gb); 0: no bound. A switch that would
	// pass it demotes the group's least recently used level-1 sleepers to
	// level 2 while the group's GPU is free (docs/switching.md).
	HostMemoryBudgetGB float64 `yaml:"host_memory_budget_gb"`
}

// Defaults.
const (
	defaultRequestTimeout = 300 * time.Second
	defaultSwitchTimeout  = 120 * time.Second
	defaultMaxPrewarm     = time.Hour
	defaultProbePrompt    = "The capital of France is"
)

func (c Controller) requestTimeout() time.Duration {
	return seconds(c.RequestTimeoutS, defaultRequestTimeout)
}
func (c Controller) switchTimeout() time.Duration {
	return seconds(c.SwitchTimeoutS, defaultSwitchTimeout)
}
func (c Controller) minAwake() time.Duration   { return seconds(c.MinAwakeS, 0) }
func (c Controller) maxPrewarm() time.Duration { return seconds(c.MaxPrewarmS, defaultMaxPrewarm) }

func (c Controller) probePrompt() string {
	if c.ProbePrompt != "" {
		return c.ProbePrompt
	}
	return defaultProbePrompt
}

func (c Controller) policy() string {
	if c.Policy == "" {
		return PolicySleepPrevious
	}
	return c.Policy
}

func seconds(s durations.Seconds, def time.Duration) time.Duration {
	if s <= 0 {
		return def
	}
	return s.Duration()
}

// servedName is the engine's name for the model.
// ServedName is the engine's name for the model of this alias.
func (m Model) ServedName(alias string) string {
	if m.ServedModelName != "" {
		return m.ServedModelName
	}
	return alias
}

// Level is the model's sleep level (1 unless 2).
func (m Model) Level() int { return max(m.SleepLevel, 1) }

// Check says what is wrong with a configuration's models and controller.
func Check(models map[string]Model, c Controller) error {
	switch c.policy() {
	case PolicySleepPrevious, PolicyAwakePrevious:
	default:
		return fmt.Errorf("controller.policy %q: want %s or %s", c.Policy, PolicySleepPrevious, PolicyAwakePrevious)
	}
	if c.RequestTimeoutS < 0 || c.SwitchTimeoutS < 0 || c.MinAwakeS < 0 || c.MaxPrewarmS < 0 || c.HostMemoryBudgetGB < 0 {
		return fmt.Errorf("controller: request_timeout_s, switch_timeout_s, min_awake_s, max_prewarm_s and host_memory_budget_gb must not be negative")
	}
	if c.StartupAwakeModel != "" {
		if _, ok := models[c.StartupAwakeModel]; !ok {
			return fmt.Errorf("controller.startup_awake_model %q is not one of the models", c.StartupAwakeModel)
		}
	}
	served := map[string]string{}
	for _, alias := range slices.Sorted(maps.Keys(models)) {
		m := models[alias]
		where := "models." + alias
		if m.TTLS < 0 {
			return fmt.Errorf("%s.ttl_s: %v must not be negative (0: no idle sleep)", where, m.TTLS)
		}
		if alias == "" || strings.ContainsAny(alias, "/?# ") {
			return fmt.Errorf("%s: an alias must be non-empty, without '/', '?', '#' or spaces", where)
		}
		u, err := url.Parse(m.BackendURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s.backend_url %q: want http(s)://host:port", where, m.BackendURL)
		}
		if m.SleepLevel != 0 && m.SleepLevel != 1 && m.SleepLevel != 2 {
			return fmt.Errorf("%s.sleep_level %d: want 1 or 2", where, m.SleepLevel)
		}
		for _, t := range m.WakeTags {
			if t != "weights" && t != "kv_cache" {
				return fmt.Errorf("%s.wake_tags: unknown tag %q (weights, kv_cache)", where, t)
			}
		}
		if m.HostMemoryGB < 0 {
			return fmt.Errorf("%s.host_memory_gb must not be negative", where)
		}
		if len(m.LaunchCommand) == 0 && (len(m.Env) > 0 || m.Cwd != "") {
			return fmt.Errorf("%s: env and cwd belong to a launch_command", where)
		}
		// One engine sleeps and wakes as one: two aliases on it would
		// put each other to sleep.
		key := strings.TrimRight(m.BackendURL, "/")
		if other, dup := served[key]; dup {
			return fmt.Errorf("%s and models.%s name the same backend %s", where, other, key)
		}
		served[key] = alias
	}
	return nil
}

// groupsOf partitions the aliases into the groups whose members share a
// GPU, by the policy: named groups as named; ungrouped models together
// (always_sleep_previous) or each alone (always_awake_previous).
func groupsOf(models map[string]Model, policy string) map[string][]string {
	out := map[string][]string{}
	for _, alias := range slices.Sorted(maps.Keys(models)) {
		g := models[alias].Group
		switch {
		case g != "":
			g = "group:" + g
		case policy == PolicyAwakePrevious:
			g = "model:" + alias
		default:
			g = "group:"
		}
		out[g] = append(out[g], alias)
	}
	for _, members := range out {
		slices.Sort(members)
	}
	return out
}

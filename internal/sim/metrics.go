package sim

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// engineMetrics are the vllm: metrics vLLM's /metrics serves, with its
// label names (model_name, engine), on a registry of this engine's own.
type engineMetrics struct {
	reg              *prometheus.Registry
	promptTokens     prometheus.Counter
	generationTokens prometheus.Counter
	preemptions      prometheus.Counter
	success          *prometheus.CounterVec
	ttft             prometheus.Observer
	itl              prometheus.Observer
	e2e              prometheus.Observer
	queueTime        prometheus.Observer
	prefixQueries    prometheus.Counter
	prefixHits       prometheus.Counter
	stepSeconds      prometheus.Observer
	computeSeconds   prometheus.Observer
}

func newEngineMetrics(e *Engine) *engineMetrics {
	labels := prometheus.Labels{"model_name": e.cfg.ServedModelNames[0], "engine": "0"}
	reg := prometheus.NewRegistry()
	f := func(c prometheus.Collector) { reg.MustRegister(c) }
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels})
		f(c)
		return c
	}
	hist := func(name, help string, buckets []float64) prometheus.Observer {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: labels, Buckets: buckets})
		f(h)
		return h
	}
	gauge := func(name, help string, fn func(*Engine) float64) {
		f(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, func() float64 {
			e.lock()
			defer e.mu.Unlock()
			return fn(e)
		}))
	}
	latency := []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	m := &engineMetrics{
		reg:              reg,
		promptTokens:     counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
		generationTokens: counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
		preemptions:      counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
		prefixQueries:    counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
		prefixHits:       counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
		ttft:             hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", latency),
		itl:              hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", latency),
		e2e:              hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency),
		queueTime:        hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", latency),
		stepSeconds:      hist("vhi_sim_step_modelled_seconds", "Modelled duration of each engine step.", prometheus.ExponentialBuckets(0.001, 2, 12)),
		computeSeconds:   hist("vhi_sim_step_compute_seconds", "Real CPU time the simulator spent computing each step (KV writes and reads).", prometheus.ExponentialBuckets(0.0001, 2, 14)),
	}
	m.success = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: labels,
	}, []string{"finished_reason"})
	f(m.success)
	for _, reason := range []string{"stop", "length", "abort"} {
		m.success.WithLabelValues(reason)
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", func(e *Engine) float64 { return float64(len(e.running)) })
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", func(e *Engine) float64 { return float64(len(e.waiting)) })
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(e *Engine) float64 {
		t := e.pool.total()
		return float64(t-e.pool.numFree()) / float64(t)
	})
	sleepState := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vllm:engine_sleep_state", Help: "Engine sleep state; awake = 0 means engine is sleeping.", ConstLabels: labels,
	}, []string{"sleep_state"})
	f(collectFunc{desc: sleepState, collect: func(ch chan<- prometheus.Metric) {
		e.lock()
		sleeping, level := e.sleeping, e.sleepLevel
		e.mu.Unlock()
		set := func(state string, on bool) {
			v := 0.0
			if on {
				v = 1
			}
			sleepState.WithLabelValues(state).Set(v)
		}
		set("awake", !sleeping)
		set("weights_offloaded", sleeping && level == 1)
		set("discard_all", sleeping && level == 2)
		sleepState.Collect(ch)
	}})
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig",
		ConstLabels: prometheus.Labels{
			"block_size": strconv.Itoa(e.geo.BlockSize), "num_gpu_blocks": strconv.Itoa(e.geo.NumBlocks),
			"cache_dtype": "auto", "engine": "0", "enable_prefix_caching": pythonBool(e.cfg.EnablePrefixCaching),
		},
	})
	info.Set(1)
	f(info)
	return m
}

func (m *engineMetrics) finished(r *request, now time.Time) {
	m.success.WithLabelValues(r.finishReason).Inc()
	m.e2e.Observe(now.Sub(r.arrival).Seconds())
}

func (m *engineMetrics) stepDone(modelled, compute time.Duration) {
	m.stepSeconds.Observe(modelled.Seconds())
	m.computeSeconds.Observe(compute.Seconds())
}

// pythonBool is how vLLM's info metrics write a flag (Python's str).
func pythonBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

// collectFunc adapts a describe/collect pair computed at scrape time.
type collectFunc struct {
	desc    prometheus.Collector
	collect func(chan<- prometheus.Metric)
}

func (c collectFunc) Describe(ch chan<- *prometheus.Desc) { c.desc.Describe(ch) }
func (c collectFunc) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }
